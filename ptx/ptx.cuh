// Umbrella include for the kernels.
#pragma once
#include "atomic.cuh"
#include "bswap.cuh"
#include "bulk.cuh"
#include "fence.cuh"
#include "ld_st.cuh"
#include "sync.cuh"
