"""Build deepcomm: the Python package always, the CUDA extensions when nvcc is found: deepcomm._C (the library,
every csrc/ source outside csrc/selftest/) and deepcomm._selftest (test-only: csrc/selftest/ alone, plus headers).

Each extension is compiled and linked by nvcc alone (sm_90, static cudart, pybind11 headers). Neither includes or
links libtorch or libcuda, so one build serves any torch version and links on machines without a GPU driver.
Set DEEPCOMM_NO_CUDA=1 to force a Python-only install, DEEPCOMM_CUDA_ARCH to change the target (default 90).
The build writes deepcomm/_build_info.json (arch, nvcc version, NVSHMEM headers) for `python -m deepcomm`.
deepcomm._C never links NVSHMEM (its host library is opened at run time); its headers, from NVSHMEM_HOME or the
nvidia-nvshmem wheel, are needed to compile csrc/transport/nvshmem_*.cpp, which are skipped when absent.
A third, optional module, deepcomm._nvshmem_kernels (csrc/nvshmem_kernels/ plus the hierarchical kernels compiled
again with the NVSHMEM poster, -DDEEPCOMM_NVSHMEM_DEVICE=1), is built only where NVSHMEM's device library
(lib/libnvshmem_device.a) and host library are found next to those headers: relocatable device code (-rdc), device-linked against
libnvshmem_device.a, with libnvshmem_host.so.3 as a dependency (rpath to its directory); no libtorch, no libcuda.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def find_nvcc():
    if os.environ.get("DEEPCOMM_NO_CUDA") == "1":
        return None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def find_nvshmem_include():
    """The NVSHMEM include directory (NVSHMEM_HOME, else the nvidia-nvshmem wheel), or None."""
    homes = [os.environ.get("NVSHMEM_HOME")]
    try:
        import importlib.util
        spec = importlib.util.find_spec("nvidia.nvshmem")
        homes += list(spec.submodule_search_locations or []) if spec else []
    except (ImportError, ValueError):
        pass
    for home in homes:
        if home and (Path(home) / "include" / "nvshmem_host.h").exists():
            return Path(home) / "include"
    return None


def find_nvshmem_device_lib(include):
    """NVSHMEM's lib/ directory next to ``include`` when it holds the device archive and the host library, else None:
    what deepcomm._nvshmem_kernels links."""
    if include is None:
        return None
    lib = Path(include).parent / "lib"
    return lib if (lib / "libnvshmem_device.a").exists() and (lib / "libnvshmem_host.so.3").exists() else None


NVSHMEM_KERNELS = "deepcomm._nvshmem_kernels"


def is_nvshmem_source(rel):
    """Sources that include NVSHMEM headers: skipped without them."""
    return Path(rel).name.startswith("nvshmem_")


def cuda_home(nvcc):
    for home in (os.environ.get("CUDA_HOME"), str(Path(nvcc).resolve().parent.parent), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_runtime.h").exists():
            return Path(home)
    return Path(nvcc).resolve().parent.parent


class NvccBuild(build_ext):
    """Compile the sources of every extension with nvcc in one parallel pool (each source once), then link each
    module with nvcc."""

    def build_extensions(self):
        nvcc = find_nvcc()
        home = cuda_home(nvcc)
        import pybind11

        arch = os.environ.get("DEEPCOMM_CUDA_ARCH", "90")
        includes = [
            str(ROOT),
            str(ROOT / "csrc"),
            pybind11.get_include(),
            sysconfig.get_paths()["include"],
            str(home / "include"),
            str(home / "include" / "cccl"),  # CUDA 13 keeps cuda/std, cub, thrust here
        ]
        common = ["-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden"]
        common += [f"-I{p}" for p in includes]
        nvshmem_include = find_nvshmem_include()
        if nvshmem_include is None:
            print("deepcomm: NVSHMEM headers not found (pip install nvidia-nvshmem-cu13, or set NVSHMEM_HOME): "
                  "building without NVSHMEM support; DEEPCOMM_LL_MEMORY=nvshmem will raise", file=sys.stderr)
        else:
            print(f"deepcomm: NVSHMEM headers from {nvshmem_include} (the library is loaded at run time)")
        nvshmem_lib = find_nvshmem_device_lib(nvshmem_include)
        if nvshmem_lib is None:
            print("deepcomm: NVSHMEM device library not found: skipping deepcomm._nvshmem_kernels "
                  "(internode_transport='nvshmem' will raise; 'nvshmem-host' and 'emulated' work)", file=sys.stderr)
            self.extensions = [e for e in self.extensions if e.name != NVSHMEM_KERNELS]
        sources = {ext.name: [s for s in ext.sources if nvshmem_include is not None or not is_nvshmem_source(s)]
                   for ext in self.extensions}
        cu_flags = [f"-gencode=arch=compute_{arch},code=sm_{arch}", "-lineinfo", "--expt-relaxed-constexpr"]
        build_tmp = Path(self.build_temp) / "deepcomm"
        build_tmp.mkdir(parents=True, exist_ok=True)

        def compile_one(job):
            rel, device_puts = job
            src = str(ROOT / rel)
            obj = build_tmp / (("nvshmem_device_" if device_puts else "") + rel.replace("/", "_") + ".o")
            dep, stamp = obj.with_suffix(".d"), obj.with_suffix(".cmd")
            flags = common + (cu_flags if src.endswith(".cu") else ["-x", "c++"])
            if nvshmem_include is not None and "nvshmem" in Path(rel).name:  # incl. the NVSHMEM bindings
                flags = flags + [f"-I{nvshmem_include}", "-DDEEPCOMM_WITH_NVSHMEM=1"]
            if device_puts:  # deepcomm._nvshmem_kernels: relocatable device code calling NVSHMEM's device API
                flags = flags + [f"-I{nvshmem_include}", "-DDEEPCOMM_NVSHMEM_DEVICE=1"] + (
                    ["-rdc=true"] if src.endswith(".cu") else [])
            cmd = [nvcc, *flags, "-c", src, "-o", str(obj)]
            if up_to_date(obj, dep, stamp, " ".join(cmd)):
                return str(obj)
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd + ["-MD", "-MF", str(dep)], check=True)
            stamp.write_text(" ".join(cmd))
            return str(obj)

        jobs = int(os.environ.get("DEEPCOMM_BUILD_JOBS", os.cpu_count() or 2))
        every = list(dict.fromkeys((rel, ext.name == NVSHMEM_KERNELS) for ext in self.extensions
                                   for rel in sources[ext.name]))
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            objects = dict(zip(every, pool.map(compile_one, every)))
        for ext in self.extensions:
            out = Path(self.get_ext_fullpath(ext.name))
            out.parent.mkdir(parents=True, exist_ok=True)
            device_puts = ext.name == NVSHMEM_KERNELS
            # The NVSHMEM module: nvcc device-links the -rdc objects with libnvshmem_device.a, then links the host
            # library by soname (the one deepcomm._C dlopens), found through the rpath.
            extra = (["-rdc=true", f"-L{nvshmem_lib}", "-lnvshmem_device", "-l:libnvshmem_host.so.3",
                      "-Xlinker", f"-rpath={nvshmem_lib}"] if device_puts else [])
            link = [nvcc, "-shared", f"-gencode=arch=compute_{arch},code=sm_{arch}",
                    *(objects[(rel, device_puts)] for rel in sources[ext.name]), "-o", str(out), *extra,
                    "-cudart=static", "-lrt", "-ldl", "-lpthread"]
            print(" ".join(link), flush=True)
            subprocess.run(link, check=True)
            if ext.name == "deepcomm._C":
                write_build_info(out.parent / "_build_info.json", nvcc, arch, nvshmem_include)


def write_build_info(path: Path, nvcc: str, arch: str, nvshmem_include) -> None:
    """What `python -m deepcomm` reports about this build: the CUDA arch, nvcc's version, NVSHMEM's headers."""
    try:
        version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    except (OSError, IndexError):
        version = None
    path.write_text(json.dumps({"cuda_arch": f"sm_{arch}", "nvcc": version,
                                "nvshmem_headers": None if nvshmem_include is None else str(nvshmem_include)}))


def up_to_date(obj: Path, dep: Path, stamp: Path, cmd: str) -> bool:
    """Rebuilds touch only what changed: the object is newer than its source and every header nvcc listed in the
    dependency file, and it was built with the same command."""
    if not (obj.exists() and dep.exists() and stamp.exists()) or stamp.read_text() != cmd:
        return False
    text = dep.read_text().replace("\\\n", " ")
    inputs = text.split(":", 1)[1].split() if ":" in text else []
    built = obj.stat().st_mtime
    return bool(inputs) and all(Path(p).exists() and Path(p).stat().st_mtime <= built for p in inputs)


SELFTEST_DIR = ROOT / "csrc" / "selftest"


NVSHMEM_KERNELS_DIR = ROOT / "csrc" / "nvshmem_kernels"
# The kernels deepcomm._nvshmem_kernels compiles again, with the NVSHMEM poster (csrc/kernels/hier_nvshmem_poster.cuh).
NVSHMEM_KERNEL_SOURCES = ["csrc/kernels/hier_dispatch.cu", "csrc/kernels/hier_combine.cu"]


def extension_sources(folder: Path, skip=()):
    """The .cu and .cpp files under `folder` (none under a folder of `skip`), relative to setup.py, as setuptools
    requires."""
    srcs = sorted(folder.rglob("*.cu")) + sorted(folder.rglob("*.cpp"))
    return [p.relative_to(ROOT).as_posix() for p in srcs if not any(s in p.parents for s in skip)]


ext_modules, cmdclass = [], {}
if find_nvcc() is not None:
    # The self-test module compiles only its own sources: what it needs from the library is header-only.
    ext_modules = [Extension("deepcomm._C", sources=extension_sources(ROOT / "csrc",
                                                                      skip=(SELFTEST_DIR, NVSHMEM_KERNELS_DIR))),
                   Extension("deepcomm._selftest", sources=extension_sources(SELFTEST_DIR)),
                   # dropped at build time when NVSHMEM's device library is not found (NvccBuild)
                   Extension(NVSHMEM_KERNELS, sources=extension_sources(NVSHMEM_KERNELS_DIR) + NVSHMEM_KERNEL_SOURCES)]
    cmdclass = {"build_ext": NvccBuild}
else:
    print("deepcomm: nvcc not found, installing the Python-only package (reference backend)", file=sys.stderr)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
