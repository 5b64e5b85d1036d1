"""C++ kernels for the CPU (csrc/), built once per torch and CPU into one library of torch ops."""
