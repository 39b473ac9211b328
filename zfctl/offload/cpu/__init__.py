"""The host side: the host's optimizer state, the CPU worker that runs the native AdamW, the
schedule that decides when an update is submitted and installed, and the cores it runs on.
"""
