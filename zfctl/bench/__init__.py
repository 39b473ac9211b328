"""zfctl.bench."""
