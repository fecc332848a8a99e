"""The kernel and layer micro-benchmarks behind `python benchmarks/kernels.py <name>`: one module
per part of the model (loss and head, conv, SSD scan, attention, layers, whole model and
optimizer step). Each benchmark is a pair `<name>_arguments(ap)` (its command line) and
`<name>(args)` (the run, its docstring the subcommand's help); kernels.py is the only entry point.
Timing, result files and the launch-sweep helpers come from benchmarks/common.py."""
