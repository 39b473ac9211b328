"""Which columns the device owns: the selection, its schedule, and the migration of their
optimizer state between host and device.
"""
