// specee-placement.cpp: which device holds each layer (-ngl, first or last offload order, -ts, --device), ggml RPC
// servers as devices (--rpc), and the copies of the offloaded weights in their devices' buffers.
//
// A layer's weights are copied from the file mapping into a buffer of its device (the CPU's stay mapped); the
// output (output norm and lm_head) and the draft head go to the output's device. The context puts each layer's
// KV cache on the same device and lets ggml's scheduler move the hidden state where the layers change devices.
#include "specee-placement.h"

#include "specee-impl.h"
#include "specee-model.h"

#include "ggml-backend.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <sstream>

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
        ggml_backend_reg_t reg = add(ep.c_str());
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

// the weights of layer il (nullptr entries skipped)
static std::vector<ggml_tensor **> layer_weights(specee_layer & l) {
    return {&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm, &l.ffn_gate, &l.ffn_up, &l.ffn_down};
}

static std::vector<ggml_tensor **> output_weights(specee_model & m) {
    std::vector<ggml_tensor **> w = {&m.output_norm, &m.output};
    if (m.eagle.version > 0) {
        specee_eagle & e = m.eagle;
        for (ggml_tensor ** t : layer_weights(e.layer)) {
            w.push_back(t);
        }
        for (ggml_tensor ** t : {&e.tok_embd, &e.fc, &e.fc_b, &e.output}) {
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

void specee_place_weights(specee_model & m, const specee_model_params & p) {
    const int32_t n_layer = (int32_t) m.hparams.n_layer;
    const std::vector<ggml_backend_dev_t> devs = pick_devices(p.devices, specee_rpc_add(p.rpc_servers));
    int32_t ngl = p.n_gpu_layers < 0 ? n_layer + 1 : p.n_gpu_layers;
    std::string note;
    if (ngl > n_layer + 1) {
        note = specee_format("-ngl %d is more than the model's %d layers and its output: all are offloaded", ngl, n_layer);
        ngl  = n_layer + 1;
    }
    if (devs.empty() || ngl == 0) {
        ngl = 0;
        if (p.n_gpu_layers > 0) {
            note = specee_format("-ngl %d: no device to offload to (add RPC servers with --rpc, or build ggml with "
                                 "CUDA); everything stays on the CPU", p.n_gpu_layers);
        }
    }
    const bool first = p.offload_order == SPECEE_OFFLOAD_FIRST ||
                       (p.offload_order == SPECEE_OFFLOAD_AUTO && m.exit.n_pred > 0);
    if (p.offload_order < SPECEE_OFFLOAD_AUTO || p.offload_order > SPECEE_OFFLOAD_LAST) {
        specee_fail("unknown offload order %d (0: auto, 1: first, 2: last)", p.offload_order);
    }

    // split points over the devices: the given shares, or the devices' free memory
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

    // the offloaded units in order: layers (first: 0..; last: as llama.cpp counts, ending with the output) and
    // where the output goes; unit k of ngl lands on the device whose split range holds k / ngl
    auto device_of_unit = [&](int32_t k) {
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

    // keep the devices that got something, renumbered
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

    // copy, and describe
    std::string desc;
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
    m.placement = (note.empty() ? "" : "note: " + note + "\n") + desc +
                  specee_format("offload order %s: %s", first ? "first" : "last",
                                first ? "the first layers on the devices (SpecEE's)" : "the last layers (llama.cpp's)");
}

void specee_place_eagle(specee_model & m) {
    if (m.output_device < 0 || m.eagle.version == 0) {
        return;
    }
    specee_eagle & e = m.eagle;
    std::vector<ggml_tensor **> t = layer_weights(e.layer);
    for (ggml_tensor ** x : {&e.tok_embd, &e.fc, &e.fc_b, &e.output}) {
        t.push_back(x);
    }
    copy_to_device(m, m.devices[m.output_device], t);
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
