"""zfctl.train."""
