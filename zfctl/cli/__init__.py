"""zfctl.cli."""
