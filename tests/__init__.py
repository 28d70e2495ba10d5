"""deepcomm's tests, by subject; GPU tests (marked `gpu`) sit beside the CPU tests of their subject.

A package, so that test modules and tests.helpers import by full name (tests.normal.test_normal): processes
started with spawn find the functions they are handed by that name."""
