"""The device side: AdamW of the device-owned columns, the install of the host's update, and
the PCIe transfers and page-locked buffers they use.
"""
