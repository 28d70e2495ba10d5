"""Launchers on the CPU: torchrun as 2 "nodes" on one host, deepcomm.launch_mpi's bootstrap (with a file-backed
stand-in for the MPI communicator, and with real MPI when mpirun and mpi4py are installed).

Every child process has a hard timeout, so a broken rendezvous fails the test instead of hanging it.
"""
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from tests.helpers.paths import ROOT

SMOKE = os.path.join(ROOT, "launch", "smoke_dispatch.py")
TIMEOUT = 120


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run_two_and_check(commands, who):
    """Start both commands, wait for both, require exit 0 and rank 0's smoke-test success line."""
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    outs = _wait_all(procs)
    for n, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"{who} {n} exited with {p.returncode}:\n{out}"
    assert "2 ranks, backend=reference" in outs[0] and "OK" in outs[0], outs[0]


def _wait_all(procs):
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


@pytest.mark.skipif(importlib.util.find_spec("torch.distributed.run") is None and shutil.which("torchrun") is None,
                    reason="torchrun is not available")
def test_torchrun_two_nodes_on_one_host():
    port = _free_port()
    _run_two_and_check([[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                         "--max-restarts", "0", SMOKE, "--device", "cpu"] for n in (0, 1)], "node")


_FILE_COMM = textwrap.dedent("""
    import os, pickle, sys, time
    from deepcomm.launch_mpi import main

    class FileComm:  # what launch_mpi needs of an mpi4py communicator, over a shared directory
        def __init__(self, rank, size, path):
            self.rank, self.size, self.path = rank, size, path
        def Get_rank(self):
            return self.rank
        def Get_size(self):
            return self.size
        def Split_type(self, split_type, key=0):
            return self  # one node
        def bcast(self, obj, root=0):
            f = os.path.join(self.path, "bcast")
            if self.rank == root:
                with open(f + ".tmp", "wb") as fh:
                    pickle.dump(obj, fh)
                os.replace(f + ".tmp", f)
                return obj
            deadline = time.time() + 60
            while not os.path.exists(f):
                if time.time() > deadline:
                    raise TimeoutError("bcast")
                time.sleep(0.05)
            with open(f, "rb") as fh:
                return pickle.load(fh)

    rank, size, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    sys.exit(main(sys.argv[4:], comm=FileComm(rank, size, path)))
""")


def test_launch_mpi_bootstrap_with_stand_in_comm(tmp_path):
    script = tmp_path / "file_comm.py"
    script.write_text(_FILE_COMM)
    _run_two_and_check([[sys.executable, str(script), str(r), "2", str(tmp_path), "--backend", "gloo", SMOKE,
                         "--device", "cpu"] for r in (0, 1)], "rank")


def test_launch_mpi_argument_split():
    from deepcomm.launch_mpi import _split
    assert _split(["--backend", "gloo", "-m", "deepcomm.bench", "--json", "x"]) == \
        (["--backend", "gloo"], ["-m", "deepcomm.bench", "--json", "x"])
    assert _split(["--master-port=5", "--", "s.py", "--backend", "nccl"]) == (["--master-port=5"],
                                                                              ["s.py", "--backend", "nccl"])
    assert _split(["script.py"]) == ([], ["script.py"])


@pytest.mark.skipif(shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
                    reason="needs mpirun and mpi4py (not installed on this machine)")
def test_mpirun_two_processes():
    env = dict(_env(), LAUNCH_MPI_ARGS="--backend gloo", NP="2")
    p = subprocess.run(["bash", os.path.join(ROOT, "launch", "mpirun.sh"), SMOKE, "--device", "cpu"], cwd=ROOT,
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stdout
    assert "OK" in p.stdout, p.stdout
