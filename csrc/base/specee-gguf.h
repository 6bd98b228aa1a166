// specee-gguf.h: reading a GGUF file: opening it (with ggml's reasons when it refuses one), metadata as typed values
// with bounds or as printable text, tensors by name with their shape and type checked, and the file's data mapped
// with its tensors pointing into it. What the keys and tensors mean is the loader's (specee-loader.cpp).
#pragma once

#include "specee-arch.h"

#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"

#include <cstdint>
#include <string>
#include <vector>

// a GGUF file whose tensors point into its mapping (or an owned copy when not mmapped)
struct specee_gguf_file {
    gguf_context *        gguf     = nullptr;
    ggml_context *        ctx_meta = nullptr; // tensor metadata; data points into the mapping
    ggml_backend_buffer_t buf      = nullptr; // a CPU buffer over the mapping
    void *                addr     = nullptr; // mapping (or owned copy) of the whole file
    size_t                size     = 0;
    bool                  mapped   = false;

    ~specee_gguf_file();
};

// gguf_init_from_file (metadata only), with the reasons ggml logs for a rejected file joined into `why` ("no reason
// given" when it logged none); nullptr when rejected
gguf_context * specee_gguf_open(const char * path, ggml_context ** ctx_meta, std::string & why);

// "{arch}.xxx" keys: the format ("%s.xxx") with the architecture
std::string specee_gguf_key(const char * fmt, const std::string & arch);
// An integer key (any integer type, or a per-layer array of int32/uint32 whose entries agree) that must lie in
// [lo, hi]; false when absent and not required
bool specee_gguf_get_int(const gguf_context * g, const std::string & key, uint32_t & out, int64_t lo, int64_t hi,
                         bool required);
// a float key that, when present, must be finite and in (lo, hi); false when absent
bool specee_gguf_get_f32_in(const gguf_context * g, const std::string & key, float & out, float lo, float hi);
// a string key, "" when absent or not a string
std::string specee_gguf_get_str(const gguf_context * g, const std::string & key);
// key id's value as text (short arrays listed, long ones as "[type x n]")
std::string specee_gguf_value_str(const gguf_context * g, int64_t id);

// Tensor `which` (of layer il) in cm, read from `path`: its shape must be `shape`; a vector must be F32, a matrix of
// a type with CPU kernels. nullptr when absent and not required.
ggml_tensor * specee_gguf_tensor(ggml_context * cm, const std::string & path, specee_tensor which, int il,
                                 std::vector<int64_t> shape, bool required = true);

// maps (or reads, without mmap) the file at path into f.addr / f.size
void specee_gguf_map(specee_gguf_file & f, const std::string & path, bool use_mmap);
// the pages of f holding [data, data + n), once their bytes were copied elsewhere and are not read again: handed back
// to the OS (a mapping's pages drop out of the process's resident memory and fault in again from the file if read; an
// owned copy's whole pages inside the range are freed and read as zeros). Nothing when the range is not f's.
void specee_gguf_release(const specee_gguf_file & f, const void * data, size_t n);
// checks every tensor of f lies inside the file, then points them into the mapping through one CPU buffer
void specee_gguf_bind_tensors(specee_gguf_file & f, const std::string & path);

// row `row` of a 2-D tensor of the file mapping (bound: specee_gguf_bind_tensors) as ne[0] floats, converted from its
// type; throws for a type that cannot be read as floats
void specee_gguf_row_f32(const ggml_tensor * t, int64_t row, float * out);
// a tensor of the file mapping as floats: its own data when it is contiguous F32, else converted into `scratch`
const float * specee_gguf_tensor_f32(const ggml_tensor * t, std::vector<float> & scratch);
