// specee-openmp.h: the OpenMP runtime's barrier setting for the tools (specee-openmp.cpp says why)
#pragma once

// First thing in main: where GOMP_SPINCOUNT is not set, sets it and runs the tool again with it (libgomp reads it
// once, when it is loaded, before main); returns where it is set already or the tool cannot be run again.
void specee_openmp_setup(char ** argv);
