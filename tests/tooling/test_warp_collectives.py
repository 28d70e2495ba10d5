"""A warp collective (``__shfl_sync``, ``__ballot_sync``, ``__syncwarp``, ...) or a block barrier inside a loop
whose first index is the lane's or the thread's own (``for (i = lane; i < n; i += 32)``) is reached by only the
lanes whose index is under the bound in the last pass: with a full mask the warp then hangs (the dispatch kernel
did, on rows under 512 bytes). Such loops must step per warp instead (``for (first = 0; ...) i = first + lane``).
This reads the kernel sources, so it runs without a GPU."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted(p for d in ("csrc", "ptx") for p in (ROOT / d).rglob("*") if p.suffix in (".cu", ".cuh", ".hpp"))
# a for loop whose induction variable starts at a per-lane / per-thread value
LANE_START = re.compile(r"\bfor\s*\(\s*(?:const\s+)?(?:[\w:]+\s+)?(\w+)\s*=\s*([^;]*)\b(?:lane|tid|threadIdx\.x)\b")
COLLECTIVE = re.compile(r"__shfl\w*_sync|__ballot_sync|__all_sync|__any_sync|__match_\w+_sync|__reduce_\w+_sync|"
                        r"__syncwarp|__syncthreads|\bshfl\.sync|\bvote\.sync|\bbar\.sync|\bbar\.warp\.sync")


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _loop_body(text: str, start: int) -> str:
    """The statement a ``for`` header at ``start`` governs: its braced block, or the single statement after it."""
    depth, i = 0, text.index("(", start)
    while True:  # the header's closing parenthesis
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
        if depth == 0:
            break
    rest = text[i:]
    lead = len(rest) - len(rest.lstrip())
    if not rest[lead:].startswith("{"):
        return rest[:rest.find(";") + 1]
    depth = 0
    for j in range(i + lead, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + lead:j + 1]
    return text[i + lead:]


def lane_loops_with_collectives(text: str):
    """``(line, loop header)`` of each loop starting at a lane's own index whose body holds a warp collective."""
    text = _strip_comments(text)
    found = []
    for m in LANE_START.finditer(text):
        if COLLECTIVE.search(_loop_body(text, m.start())):
            found.append((text.count("\n", 0, m.start()) + 1, text[m.start():text.find("\n", m.start())].strip()))
    return found


def test_no_warp_collective_inside_a_loop_that_starts_at_the_lane():
    assert SOURCES, "no kernel sources found"
    bad = [f"{p.relative_to(ROOT)}:{line}: {header}" for p in SOURCES
           for line, header in lane_loops_with_collectives(p.read_text())]
    assert not bad, "warp collectives in loops bounded per lane:\n" + "\n".join(bad)


def test_the_check_finds_the_loop_that_hung():
    hung = """
    for (int64_t base = lane; base < n16; base += 32 * kUnroll) {
      int4 v[kUnroll];
      for (int d = 0; d < R; ++d) {
        int4* out = reinterpret_cast<int4*>(__shfl_sync(0xffffffffu, ptr, d));  // a comment { with a brace
      }
    }
    """
    assert [line for line, _ in lane_loops_with_collectives(hung)] == [2]
    per_warp = hung.replace("base = lane; base < n16; base += 32 * kUnroll",
                            "first = 0; first < n16; first += 32 * kUnroll")
    assert lane_loops_with_collectives(per_warp) == []
    one_statement = "for (int i = tid; i < n; i += blockDim.x) out[i] = __shfl_sync(0xffffffffu, v, 0);\n"
    assert len(lane_loops_with_collectives(one_statement)) == 1
    plain = "for (int i = threadIdx.x; i < n; i += blockDim.x) { out[i] = in[i]; }\n__syncthreads();\n"
    assert lane_loops_with_collectives(plain) == []
