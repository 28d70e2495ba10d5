"""Errors and timeouts: input errors found on the device, a Buffer that is never built, peers that never call or die."""
