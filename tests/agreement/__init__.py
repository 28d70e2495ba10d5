"""Call agreement: fingerprints, check_calls, the disagreement soak, and the CUDA backend's agreement words."""
