// Stand-in for the CUDA header when the kernels are compiled for the CPU emulator: emu.h
// defines the half-precision types they use.
