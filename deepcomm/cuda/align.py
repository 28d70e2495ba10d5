"""Byte arithmetic the buffers and the internode rows share."""


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return (n + multiple - 1) // multiple * multiple
