"""The gradient paths: where each step's host-owned gradient goes (a page-locked slot per
step, or the device's fp32 interval sum), and the fp16 loss scale and clip coefficient it carries.
"""
