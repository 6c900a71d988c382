"""Reference workloads that the demo, the tests and the benchmarks run.

:mod:`fxpasses.workloads.pose`: a YOLO-style dual-branch end-to-end pose loss whose two branches
share one RealNVP flow (RLE), with seeded synthetic batches at realistic sizes.
"""
