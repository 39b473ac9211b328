"""zfctl.plan."""
