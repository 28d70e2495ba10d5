"""Tools around the library: launchers, packaging, setup script, environment doc, benchmark, soak, diagnosis,
the test runners, several ranks on one GPU."""
