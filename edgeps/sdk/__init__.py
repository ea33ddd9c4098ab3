"""The C device SDK (edge_client/embedded), built and measured from Python: ``make`` with its
Makefile, the Cortex-M4F image's size (from its link map: the SDK's own code, libc/libm, the
start-up), a model's arena size, the scripted exchange on QEMU (with its instruction counts and
stack peak) and the hostile corpus on QEMU. ``edgeps bench embedded`` (edgeps/bench/embedded.py)
reports them."""
