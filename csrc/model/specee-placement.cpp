// specee-placement.cpp: where the weights live. Which device holds each layer (-ngl, first or last offload order,
// -ts, --device), ggml RPC servers as devices (--rpc), the copies of the offloaded weights in their devices' buffers,
// and the CPU's matrices repacked into the layouts its fastest kernels read.
//
// A layer's weights are copied from the file mapping into a buffer of its device (the CPU's stay mapped, or are
// repacked); the output (output norm and lm_head) and the draft head go to the output's device. The context puts
// each layer's KV cache on the same device and lets ggml's scheduler move the hidden state where the layers change
// devices.
#include "specee-placement.h"

#include "specee-arch.h"
#include "specee-impl.h"
#include "specee-kernels.h"
#include "specee-model.h"
#include "specee-rpc-client.h"

#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <sstream>

// ---- devices -------------------------------------------------------------------------------------

static std::vector<std::string> split_list(const char * text) {
    std::vector<std::string> out;
    std::stringstream        ss(text ? text : "");
    std::string              item;
    while (std::getline(ss, item, ',')) {
        out.push_back(item);
    }
    return out;
}

std::vector<ggml_backend_dev_t> specee_rpc_add(const char * servers) {
    std::vector<ggml_backend_dev_t> devs;
    if (!servers || !*servers) {
        return devs;
    }
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    auto add = rpc ? (ggml_backend_reg_t (*)(const char *)) ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server")
                   : nullptr;
    if (!add) {
        specee_fail("--rpc: this build of ggml has no RPC backend (ggml/install.sh builds it in; the prebuilt wheel "
                    "has none)");
    }
    for (const std::string & ep : split_list(servers)) {
        const size_t colon = ep.rfind(':');
        const int    port  = colon == std::string::npos ? -1 : atoi(ep.c_str() + colon + 1);
        if (colon == std::string::npos || colon == 0 || port <= 0 || port > 65535 ||
            ep.find_first_not_of("0123456789", colon + 1) != std::string::npos) {
            specee_fail("bad RPC server '%s': expected HOST:PORT, e.g. 127.0.0.1:50052", ep.c_str());
        }
        // ggml's client aborts on a malformed reply and waits forever on a silent peer: check the peer first, with
        // timeouts; with a token, ggml talks to a local relay that sent it
        const std::string host  = ep.substr(0, colon);
        const char *      token = getenv("SPECEE_RPC_TOKEN");
        specee_rpc_check_peer(host, port, token ? token : "");
        const std::string via = token && *token ? specee_rpc_relay(host, port, token) : ep;
        ggml_backend_reg_t reg = add(via.c_str());
        if (!reg) {
            specee_fail("cannot reach the ggml RPC server at %s (is specee-rpc-server running there?)", ep.c_str());
        }
        bool known = false;
        for (size_t i = 0; i < ggml_backend_reg_count(); ++i) {
            known = known || ggml_backend_reg_get(i) == reg;
        }
        if (!known) {
            ggml_backend_register(reg);
        }
        for (size_t i = 0; i < ggml_backend_reg_dev_count(reg); ++i) {
            devs.push_back(ggml_backend_reg_dev_get(reg, i));
        }
    }
    return devs;
}

static bool is_rpc(ggml_backend_dev_t dev) {
    return strcmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)), "RPC") == 0;
}

// The devices to offload to: the named ones, or every local GPU and this model's RPC servers (servers that earlier
// models of the process registered stay out unless named).
static std::vector<ggml_backend_dev_t> pick_devices(const char * names, const std::vector<ggml_backend_dev_t> & rpc) {
    std::vector<ggml_backend_dev_t> devs;
    if (names && *names) {
        for (const std::string & name : split_list(names)) {
            ggml_backend_dev_t dev = ggml_backend_dev_by_name(name.c_str());
            if (!dev || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
                std::string known;
                for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
                    ggml_backend_dev_t d = ggml_backend_dev_get(i);
                    if (ggml_backend_dev_type(d) != GGML_BACKEND_DEVICE_TYPE_CPU) {
                        known += std::string(known.empty() ? "" : ", ") + ggml_backend_dev_name(d);
                    }
                }
                specee_fail("unknown device '%s' (devices to offload to: %s)", name.c_str(),
                            known.empty() ? "none; add RPC servers with --rpc" : known.c_str());
            }
            devs.push_back(dev);
        }
        return devs;
    }
    devs = rpc;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t d = ggml_backend_dev_get(i);
        const auto         t = ggml_backend_dev_type(d);
        if ((t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU) && !is_rpc(d)) {
            devs.push_back(d);
        }
    }
    return devs;
}

// ---- placement -----------------------------------------------------------------------------------

// the weights of layer il (those it has)
static std::vector<ggml_tensor **> layer_weights(specee_layer & l) { return specee_layer_weights(l); }

static std::vector<ggml_tensor **> output_weights(specee_model & m) {
    std::vector<ggml_tensor **> w = {&m.output_norm, &m.output};
    if (m.eagle.version > 0) {
        specee_eagle & e = m.eagle;
        for (ggml_tensor ** t : layer_weights(e.layer)) {
            w.push_back(t);
        }
        for (ggml_tensor ** t : {&e.tok_embd, &e.fc, &e.fc_b, &e.output, &e.hidden_norm, &e.output_norm}) {
            w.push_back(t);
        }
    }
    return w;
}

// copies the tensors into one buffer of the device and points them there
static size_t copy_to_device(specee_model & m, ggml_backend_dev_t dev, const std::vector<ggml_tensor **> & tensors) {
    std::vector<ggml_tensor **> todo;
    for (ggml_tensor ** t : tensors) {
        if (*t) {
            todo.push_back(t);
        }
    }
    if (todo.empty()) {
        return 0;
    }
    ggml_init_params ip  = {todo.size() * ggml_tensor_overhead(), nullptr, /*no_alloc =*/true};
    ggml_context *   ctx = ggml_init(ip);
    m.ctx_dev.push_back(ctx);
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> pairs;
    std::map<ggml_tensor *, ggml_tensor *>               done; // a tied output is token_embd: copied once
    for (ggml_tensor ** t : todo) {
        if (!done.count(*t)) {
            ggml_tensor * dst = ggml_dup_tensor(ctx, *t);
            ggml_set_name(dst, ggml_get_name(*t));
            pairs.emplace_back(*t, dst);
            done[*t] = dst;
        }
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, ggml_backend_dev_buffer_type(dev));
    if (!buf) {
        specee_fail("cannot allocate the weights on %s (out of device memory? fewer layers with -ngl)",
                    ggml_backend_dev_name(dev));
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    m.buf_dev.push_back(buf);
    for (auto & [src, dst] : pairs) {
        ggml_backend_tensor_set(dst, src->data, 0, ggml_nbytes(src));
    }
    for (ggml_tensor ** t : todo) {
        *t = done[*t];
    }
    return ggml_backend_buffer_get_size(buf);
}

static std::string layer_ranges(const std::vector<int32_t> & layers) {
    std::string out;
    for (size_t i = 0; i < layers.size();) {
        size_t j = i;
        while (j + 1 < layers.size() && layers[j + 1] == layers[j] + 1) {
            ++j;
        }
        out += (out.empty() ? "" : ", ") + std::to_string(layers[i]) +
               (j > i ? "-" + std::to_string(layers[j]) : std::string());
        i = j + 1;
    }
    return out;
}

// How many units (layers, then the output) -ngl offloads: capped at all of them, 0 without a device to offload to;
// `note` says so when that is not what was asked
static int32_t offload_count(const specee_model_params & p, int32_t n_layer, size_t n_devs, std::string & note) {
    int32_t ngl = p.n_gpu_layers < 0 ? n_layer + 1 : p.n_gpu_layers;
    if (ngl > n_layer + 1) {
        note = specee_format("-ngl %d is more than the model's %d layers and its output: all are offloaded", ngl, n_layer);
        ngl  = n_layer + 1;
    }
    if (n_devs == 0 || ngl == 0) {
        ngl = 0;
        if (p.n_gpu_layers > 0) {
            note = specee_format("-ngl %d: no device to offload to (add RPC servers with --rpc, or build ggml with "
                                 "CUDA); everything stays on the CPU", p.n_gpu_layers);
        }
    }
    return ngl;
}

// split points over the devices, cumulative fractions: the given shares, or the devices' free memory
static std::vector<double> split_points(const specee_model_params & p, const std::vector<ggml_backend_dev_t> & devs) {
    if (p.n_tensor_split < 0 || (p.n_tensor_split > 0 && !p.tensor_split) ||
        (p.tensor_split && p.n_tensor_split != (int32_t) devs.size())) {
        specee_fail("--tensor-split gives %d shares for %zu devices to offload to", p.n_tensor_split, devs.size());
    }
    std::vector<double> split(devs.size());
    for (size_t d = 0; d < devs.size(); ++d) {
        size_t free = 0, total = 0;
        if (p.tensor_split) {
            if (!(p.tensor_split[d] >= 0.0f)) {
                specee_fail("--tensor-split: shares must be numbers >= 0");
            }
            split[d] = p.tensor_split[d];
        } else {
            ggml_backend_dev_memory(devs[d], &free, &total);
            split[d] = (double) free;
        }
    }
    const double sum = std::accumulate(split.begin(), split.end(), 0.0);
    for (size_t d = 0; d < devs.size(); ++d) {
        split[d] = sum > 0 ? (d ? split[d - 1] : 0.0) + split[d] / sum : double(d + 1) / devs.size();
    }
    return split;
}

// Each layer's device and the output's (indices into the devices split over, -1: the CPU). The offloaded units in
// order: layers (first: 0..; last: as llama.cpp counts, ending with the output) and where the output goes; unit k
// of ngl lands on the device whose split range holds k / ngl.
static void assign_devices(specee_model & m, int32_t ngl, bool first, const std::vector<double> & split) {
    const int32_t n_layer        = (int32_t) m.hparams.n_layer;
    auto          device_of_unit = [&](int32_t k) {
        const double f = (double) k / ngl;
        return (int32_t) (std::upper_bound(split.begin(), split.end(), f) - split.begin());
    };
    m.layer_device.assign(n_layer, -1);
    m.output_device = -1;
    if (first) {
        for (int32_t il = 0; il < std::min(ngl, n_layer); ++il) {
            m.layer_device[il] = device_of_unit(il);
        }
        m.output_device = ngl > 0 ? 0 : -1; // SpecEE: the lm_head and the draft head on the first device
    } else {
        const int32_t start = n_layer + 1 - ngl;
        for (int32_t il = std::max(start, 0); il < n_layer; ++il) {
            m.layer_device[il] = device_of_unit(il - start);
        }
        m.output_device = ngl > 0 ? device_of_unit(n_layer - start) : -1;
    }
}

// keeps the devices that got something (m.devices), renumbered
static void keep_used_devices(specee_model & m, const std::vector<ggml_backend_dev_t> & devs) {
    std::vector<int32_t> remap(devs.size(), -1);
    for (int32_t d : m.layer_device) {
        if (d >= 0) {
            remap[d] = 0;
        }
    }
    if (m.output_device >= 0) {
        remap[m.output_device] = 0;
    }
    m.devices.clear();
    for (size_t d = 0; d < devs.size(); ++d) {
        if (remap[d] == 0) {
            remap[d] = (int32_t) m.devices.size();
            m.devices.push_back(devs[d]);
        }
    }
    for (int32_t & d : m.layer_device) {
        d = d >= 0 ? remap[d] : -1;
    }
    m.output_device = m.output_device >= 0 ? remap[m.output_device] : -1;
}

// copies the offloaded weights to their devices; one line per device (the CPU first) saying what it holds
static std::string copy_and_describe(specee_model & m) {
    const int32_t n_layer = (int32_t) m.hparams.n_layer;
    std::string   desc;
    for (int32_t d = -1; d < (int32_t) m.devices.size(); ++d) {
        std::vector<int32_t>        layers;
        std::vector<ggml_tensor **> tensors;
        size_t                      bytes = 0;
        for (int32_t il = 0; il < n_layer; ++il) {
            if (m.layer_device[il] == d) {
                layers.push_back(il);
                for (ggml_tensor ** t : layer_weights(m.layers[il])) {
                    tensors.push_back(t);
                    bytes += d < 0 ? ggml_nbytes(*t) : 0;
                }
            }
        }
        const bool out_here = m.output_device == d;
        if (out_here) {
            for (ggml_tensor ** t : output_weights(m)) {
                tensors.push_back(t);
                bytes += d < 0 && *t ? ggml_nbytes(*t) : 0;
            }
        }
        if (d >= 0) {
            bytes = copy_to_device(m, m.devices[d], tensors);
        }
        if (layers.empty() && !out_here) {
            continue;
        }
        const char * name = d < 0 ? "CPU" : ggml_backend_dev_name(m.devices[d]);
        const char * what = d < 0 ? "" : ggml_backend_dev_description(m.devices[d]);
        desc += specee_format("%s%s%s%s: %s%s%s; %.1f MiB\n", name, *what ? " (" : "", what, *what ? ")" : "",
                              layers.empty() ? "" : ("layers " + layer_ranges(layers)).c_str(),
                              out_here ? (layers.empty() ? "output" : ", output") : "",
                              out_here && m.eagle.version > 0 ? ", draft head" : "", bytes / 1024.0 / 1024.0);
    }
    return desc;
}

void specee_place_weights(specee_model & m, const specee_model_params & p) {
    const int32_t                         n_layer = (int32_t) m.hparams.n_layer;
    const std::vector<ggml_backend_dev_t> devs    = pick_devices(p.devices, specee_rpc_add(p.rpc_servers));
    std::string                           note;
    const int32_t                         ngl   = offload_count(p, n_layer, devs.size(), note);
    const bool                            first = p.offload_order == SPECEE_OFFLOAD_FIRST ||
                       (p.offload_order == SPECEE_OFFLOAD_AUTO && m.exit.n_pred > 0);
    if (p.offload_order < SPECEE_OFFLOAD_AUTO || p.offload_order > SPECEE_OFFLOAD_LAST) {
        specee_fail("unknown offload order %d (0: auto, 1: first, 2: last)", p.offload_order);
    }
    assign_devices(m, ngl, first, split_points(p, devs));
    keep_used_devices(m, devs);
    const std::string desc = copy_and_describe(m);
    m.placement = (note.empty() ? "" : "note: " + note + "\n") + desc +
                  specee_format("offload order %s: %s", first ? "first" : "last",
                                first ? "the first layers on the devices (SpecEE's)" : "the last layers (llama.cpp's)");
}

// ---- repacking ---------------------------------------------------------------------------------

// a weight's bytes in the model's (or the draft head's) file, copied into another layout and not read again: its pages
// handed back (a mapping's leave the resident memory, as upstream unmaps what it copied; peak RSS on the 7B-shaped Q4_1
// file was 1.93x llama.cpp's before this)
static void release_source(const specee_model & m, const ggml_tensor * src) {
    // the file's lm_head is read from the file again for the exit predictors' features (specee-exit.cpp): a mapping's
    // pages fault back in, an owned copy's freed pages would read as zeros, so that copy keeps them
    if (!m.file.mapped && src == ggml_get_tensor(m.file.ctx_meta, specee_tensor_name(SPECEE_TENSOR_OUTPUT).c_str())) {
        return;
    }
    specee_gguf_release(m.file, src->data, ggml_nbytes(src));
    if (m.eagle_file) {
        specee_gguf_release(*m.eagle_file, src->data, ggml_nbytes(src));
    }
}

// the draft head's matrices that only matrix products read (its token_embd is read by get_rows), when the head is
// on the CPU
static std::vector<ggml_tensor **> eagle_matrices(specee_model & m) {
    specee_eagle & e = m.eagle;
    if (e.version == 0 || m.output_device >= 0) {
        return {};
    }
    std::vector<ggml_tensor **> w = {&e.fc, &e.layer.wq, &e.layer.wk, &e.layer.wv, &e.layer.wo, &e.layer.ffn_gate,
                                     &e.layer.ffn_up, &e.layer.ffn_down};
    if (e.output) {
        w.push_back(&e.output);
    }
    return w;
}

// the layers' and the output's matrices that stay on the CPU
static std::vector<ggml_tensor **> cpu_matrices(specee_model & m) {
    std::vector<ggml_tensor **> w;
    for (size_t il = 0; il < m.layers.size(); ++il) {
        if (specee_model_device_of_layer(m, (int32_t) il) >= 0) {
            continue;
        }
        specee_layer & l = m.layers[il];
        for (ggml_tensor ** t : specee_layer_weights(l, /*matrices_only =*/true)) {
            w.push_back(t);
        }
    }
    if (m.output != m.tok_embd && m.output_device < 0) {
        w.push_back(&m.output); // a tied output is also read by get_rows, which repacked data cannot serve
    }
    return w;
}

// (source, copy) pairs of tensors moved out of the file's mapping
using moved_tensors = std::vector<std::pair<ggml_tensor *, ggml_tensor *>>;

// new tensors like each *t in a buffer of type buft that the model owns, the model's pointers moved to them (their data
// not written yet); `what` names them where the buffer cannot be allocated
static moved_tensors move_into(specee_model & m, const std::vector<ggml_tensor **> & ts,
                               ggml_backend_buffer_type_t buft, const std::string & what) {
    ggml_init_params rp   = {ts.size() * ggml_tensor_overhead(), nullptr, /*no_alloc =*/true};
    ggml_context *   rctx = ggml_init(rp);
    m.ctx_repack.push_back(rctx);
    moved_tensors pairs;
    for (ggml_tensor ** t : ts) {
        ggml_tensor * dst = ggml_dup_tensor(rctx, *t);
        ggml_set_name(dst, ggml_get_name(*t));
        pairs.emplace_back(*t, dst);
        *t = dst;
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(rctx, buft);
    if (!buf) {
        specee_fail("cannot allocate %s", what.c_str());
    }
    ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    m.buf_repack.push_back(buf);
    return pairs;
}

// the sources' bytes written to the copies (the buffer type converts them: ggml's repacking), each source released
// as soon as it is copied (the load's peak)
static void copy_and_release(const specee_model & m, const moved_tensors & pairs) {
    for (const auto & p : pairs) {
        ggml_backend_tensor_set(p.second, p.first->data, 0, ggml_nbytes(p.first));
        release_source(m, p.first);
    }
}

// The CPU backend's extra buffer types hold some quantized matrices in a repacked, interleaved layout
// that its matmul kernels run faster on (e.g. Q4_0 as 8x8 blocks on AVX2), as upstream llama.cpp does by
// default. Weights of `cands` that one of them supports for their mul_mat are copied (and repacked) out of the
// mapping; everything else stays mapped.
static void repack(specee_model & m, std::vector<ggml_tensor **> cands) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!dev || cands.empty()) {
        return;
    }
    auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
        ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
    if (!get_extra || getenv("SPECEE_NO_REPACK")) {
        return;
    }

    ggml_init_params ip = {(cands.size() * 3 + 8) * ggml_tensor_overhead(), nullptr, /*no_alloc =*/true};
    std::unique_ptr<ggml_context, void (*)(ggml_context *)> probe(ggml_init(ip), ggml_free);
    std::vector<ggml_backend_buffer_type_t> chosen(cands.size(), nullptr);
    for (ggml_backend_buffer_type_t * buft = get_extra(dev); buft && *buft; ++buft) {
        // ggml's AMX tile kernels as GCC 12 compiles them with -march=native die with SIGILL on the Sapphire
        // Rapids machines this was developed on (the tile state is enabled; the fault is in the generated
        // code). ggml/install.sh builds ggml without AMX; a ggml built with it is used only on SPECEE_AMX=1
        if (strstr(ggml_backend_buft_name(*buft), "AMX") && !getenv("SPECEE_AMX")) {
            continue;
        }
        ggml_backend_buffer_t dummy = ggml_backend_buft_alloc_buffer(*buft, 0);
        for (size_t i = 0; i < cands.size(); ++i) {
            if (chosen[i]) {
                continue;
            }
            ggml_tensor * w = ggml_dup_tensor(probe.get(), *cands[i]);
            w->buffer       = dummy;
            ggml_tensor * x = ggml_new_tensor_2d(probe.get(), GGML_TYPE_F32, w->ne[0], 512);
            if (ggml_backend_dev_supports_op(dev, ggml_mul_mat(probe.get(), w, x))) {
                chosen[i] = *buft;
            }
            w->buffer = nullptr;
        }
        ggml_backend_buffer_free(dummy);
        probe.reset(ggml_init(ip));

        std::vector<size_t> idx;
        for (size_t i = 0; i < cands.size(); ++i) {
            if (chosen[i] == *buft) {
                idx.push_back(i);
            }
        }
        if (idx.empty()) {
            continue;
        }
        std::vector<ggml_tensor **> moved;
        for (size_t i : idx) {
            moved.push_back(cands[i]);
        }
        const std::string what = std::string(ggml_backend_buft_name(*buft)) + " for repacked weights";
        copy_and_release(m, move_into(m, moved, *buft, what));
    }
}

// Q4_1, Q4_0 and K-quant matrices of a multiple of 8 rows are copied out of the mapping into this runtime's eight-row
// layouts where its kernels take them (kernels auto or portable; Q4_0 instead of ggml's repacked layout, whose bits
// its tile gives): the kernel's transposition of eight rows' blocks done once, at load, and the rows read in one
// stream (docs/kernels.md). Returns their buffer (nullptr: none) and their types' names ("Q4_1", "Q4_K, Q6_K").
static ggml_backend_buffer_t hold_in_rows8(specee_model & m, std::vector<ggml_tensor **> & cands, int32_t kernels,
                                           std::string & types) {
    if (kernels == SPECEE_KERNELS_OFF ||
        (kernels == SPECEE_KERNELS_AUTO && strcmp(specee_kernels_auto_path(), "off") == 0)) {
        return nullptr;
    }
    std::vector<ggml_tensor **> fit;
    for (size_t i = 0; i < cands.size();) {
        if (specee_kernels_rows_fit(*cands[i]) && (*cands[i])->data) {
            std::string name = ggml_type_name((*cands[i])->type); // q4_1, q4_K: as the placement's other lines, Q4_K
            std::transform(name.begin(), name.end(), name.begin(), ::toupper);
            if (types.find(name) == std::string::npos) {
                types += (types.empty() ? "" : ", ") + name;
            }
            fit.push_back(cands[i]);
            cands.erase(cands.begin() + (ptrdiff_t) i);
        } else {
            ++i;
        }
    }
    if (fit.empty()) {
        return nullptr;
    }
    const std::string   what  = specee_format("%zu matrices (%s) in the kernels' eight-row layout", fit.size(),
                                              types.c_str());
    const moved_tensors pairs = move_into(m, fit, ggml_backend_cpu_buffer_type(), what);
    ggml_backend_buffer_t buf = m.buf_repack.back();
    specee_kernels_rows_hold(buf);
    for (auto & p : pairs) {
        specee_kernels_rows_pack(p.first, p.first->data, p.second->data);
        release_source(m, p.first);
    }
    return buf;
}

// Q4_K matrices stay in the file's layout where this runtime's kernel takes them (kernels auto on AVX2): ggml's
// repacked Q4_K multiplies 4 tokens or more with a GEMM whose results differ in the last bits from its one-token
// GEMV's, so a token's logits would depend on its batch (docs/kernels.md); the kernel gives ggml's vec_dot bits for
// every row count. With kernels off, ggml repacks them as upstream does (its GEMM prefills faster: docs/kernels.md)
static bool kept_for_kernels(const ggml_tensor * w, int32_t kernels) {
    return w->type == GGML_TYPE_Q4_K &&
           (kernels == SPECEE_KERNELS_PORTABLE ||
            (kernels == SPECEE_KERNELS_AUTO && strcmp(specee_kernels_auto_path(), "off") != 0));
}

// every layer on the CPU (at least one) has its matrices in one of ggml's repacking buffers, or is Q4_K in the file's
// layout under the kernels; the eight-row layouts do not count: a pass of 4 tokens costs 1.2-1.7 single passes there,
// and one draft token measured best on SmolLM2 (Q4_1 and Q4_0: docs/speculative.md)
static bool cpu_layers_batched(const specee_model & m, int32_t kernels, ggml_backend_buffer_t rows8) {
    bool any = false;
    for (size_t il = 0; il < m.layers.size(); ++il) {
        if (specee_model_device_of_layer(m, (int32_t) il) >= 0) {
            continue;
        }
        const ggml_backend_buffer_t b = m.layers[il].ffn_up->buffer;
        if (b == rows8 || (!kept_for_kernels(m.layers[il].ffn_up, kernels) &&
                           std::find(m.buf_repack.begin(), m.buf_repack.end(), b) == m.buf_repack.end())) {
            return false;
        }
        any = true;
    }
    return any;
}

// The small tensors the CPU layers still read from the file's mapping once their matrices are held elsewhere (norms,
// biases: a few KB each) copied into a buffer of their own and their pages released: each shares its pages with its
// neighbours' bytes, and where the kernel keeps the page cache in large folios one read of it maps the whole folio
// into the process (measured: a decode of SmolLM2 Q4_1 mapped 35 MB of the released matrices' pages again, its peak
// RSS read 132-172 MiB by the page cache's state).
static void own_small_tensors(specee_model & m) {
    if (!m.file.mapped || m.buf_repack.empty()) {
        return; // an owned copy's pages hold nothing else; without moved matrices the mapping is read anyway
    }
    std::vector<ggml_tensor **> small;
    for (size_t il = 0; il < m.layers.size(); ++il) {
        if (specee_model_device_of_layer(m, (int32_t) il) >= 0) {
            continue;
        }
        for (ggml_tensor ** t : specee_layer_weights(m.layers[il])) {
            if (*t && (*t)->buffer == m.file.buf && ggml_n_dims(*t) == 1) {
                small.push_back(t);
            }
        }
    }
    if (m.output_device < 0 && m.output_norm && m.output_norm->buffer == m.file.buf) {
        small.push_back(&m.output_norm);
    }
    if (!small.empty()) {
        const std::string what = specee_format("%zu small tensors (norms, biases) out of the mapping", small.size());
        copy_and_release(m, move_into(m, small, ggml_backend_cpu_buffer_type(), what));
    }
}

// every CPU layer's tensor that now lives outside the mapping has its file bytes released once more at the end: each
// was released as soon as it was copied (the load's peak), but where the page cache holds large folios reading the
// next one (or a norm) mapped its neighbours' pages again (12 MB of SmolLM2's released Q4_1 matrices)
static void release_moved(specee_model & m) {
    for (size_t il = 0; il < m.layers.size(); ++il) {
        for (ggml_tensor ** t : specee_layer_weights(m.layers[il])) {
            const ggml_tensor * src = *t ? ggml_get_tensor(m.file.ctx_meta, ggml_get_name(*t)) : nullptr;
            if (src && src != *t && (*t)->buffer != m.file.buf) {
                release_source(m, src);
            }
        }
    }
}

void specee_repack_weights(specee_model & m, int32_t kernels) {
    std::vector<ggml_tensor **> cands = cpu_matrices(m), head = eagle_matrices(m);
    cands.insert(cands.begin(), head.begin(), head.end());
    std::string                 rows8_types;
    const ggml_backend_buffer_t rows8 = hold_in_rows8(m, cands, kernels, rows8_types);
    size_t                      kept  = 0;
    for (size_t i = 0; i < cands.size();) {
        if (kept_for_kernels(*cands[i], kernels)) {
            kept += ggml_nbytes(*cands[i]);
            cands.erase(cands.begin() + (ptrdiff_t) i);
        } else {
            ++i;
        }
    }
    repack(m, cands);
    m.cpu_layers_batched = cpu_layers_batched(m, kernels, rows8);
    size_t repacked       = 0;
    for (ggml_backend_buffer_t b : m.buf_repack) {
        repacked += b != rows8 ? ggml_backend_buffer_get_size(b) : 0;
    }
    own_small_tensors(m);
    release_moved(m);
    if (rows8) {
        m.placement += specee_format("\n%s: %.1f MiB in this runtime's eight-row layout (its kernel's)%s",
                                     rows8_types.c_str(), ggml_backend_buffer_get_size(rows8) / 1024.0 / 1024.0,
                                     m.cpu_layers_batched ? " (default EAGLE tree: three draft tokens)" : "");
    }
    if (repacked > 0) {
        m.placement += specee_format("\nCPU_REPACK: %.1f MiB of %s in the CPU's interleaved layouts%s",
                                     repacked / 1024.0 / 1024.0,
                                     m.cpu_layers_batched ? "the CPU layers' matrices" : "matrices",
                                     m.cpu_layers_batched ? " (default EAGLE tree: three draft tokens)" : "");
    }
    if (kept > 0) {
        m.placement += specee_format("\nQ4_K: %.1f MiB kept in the file's layout for this runtime's kernels (the same "
                                     "results for any batch)%s", kept / 1024.0 / 1024.0,
                                     m.cpu_layers_batched ? " (default EAGLE tree: three draft tokens)" : "");
    }
}

// ---- a draft head loaded after the model ---------------------------------------------------------

void specee_place_eagle(specee_model & m) {
    if (m.output_device >= 0 && m.eagle.version > 0) {
        specee_eagle &              e = m.eagle;
        std::vector<ggml_tensor **> t = layer_weights(e.layer);
        for (ggml_tensor ** x : {&e.tok_embd, &e.fc, &e.fc_b, &e.output, &e.hidden_norm, &e.output_norm}) {
            t.push_back(x);
        }
        copy_to_device(m, m.devices[m.output_device], t);
    }
    repack(m, eagle_matrices(m));
}

// ---- C API -------------------------------------------------------------------------------------------

extern "C" int32_t specee_rpc_add_servers(const char * servers) {
    return specee_guard<int32_t>(-1, [&] {
        specee_rpc_add(servers);
        return 0;
    });
}

extern "C" int32_t specee_device_count(void) { return (int32_t) ggml_backend_dev_count(); }

extern "C" bool specee_device_info(int32_t i, const char ** name, const char ** description, size_t * free,
                                   size_t * total) {
    if (i < 0 || i >= (int32_t) ggml_backend_dev_count()) {
        return false;
    }
    ggml_backend_dev_t dev = ggml_backend_dev_get(i);
    size_t             f = 0, t = 0;
    ggml_backend_dev_memory(dev, &f, &t);
    if (name) {
        *name = ggml_backend_dev_name(dev);
    }
    if (description) {
        *description = ggml_backend_dev_description(dev);
    }
    if (free) {
        *free = f;
    }
    if (total) {
        *total = t;
    }
    return true;
}

extern "C" const char * specee_model_placement(const specee_model * model) { return model->placement.c_str(); }
