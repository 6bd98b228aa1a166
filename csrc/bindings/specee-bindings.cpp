// specee-bindings.cpp: the _core Python module, a thin layer over specee.h
#include "specee-kernels.h"
#include "specee.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <map>
#include <optional>
#include <cstring>
#include <string>
#include <vector>

namespace py = pybind11;

using i32_array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using u8_array  = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;
using i8_array  = py::array_t<int8_t, py::array::c_style | py::array::forcecast>;

static PyObject * g_error = nullptr;

[[noreturn]] static void raise_last() {
    // a message may quote the caller's bytes (a grammar's line) cut inside a character: decoded with replacements
    const char * e   = specee_last_error();
    PyObject *   msg = PyUnicode_DecodeUTF8(e, (Py_ssize_t) strlen(e), "replace");
    PyErr_SetObject(g_error, msg);
    Py_XDECREF(msg);
    throw py::error_already_set();
}

// a list from a C call that returns its length and fills up to n_max entries of out
static std::vector<int32_t> id_list(int32_t (*get)(const specee_model *, int32_t *, int32_t), const specee_model * m) {
    std::vector<int32_t> v(get(m, nullptr, 0));
    get(m, v.data(), (int32_t) v.size());
    return v;
}

// a value as the options' text form: None the default, bools true/false, a sequence comma-separated
static std::string option_text(const py::object & v);

// the strings a C call lists by index, NULL past the end
static std::vector<std::string> name_list(const char * (*get)(int32_t)) {
    std::vector<std::string> names;
    for (int32_t i = 0; get(i); ++i) {
        names.emplace_back(get(i));
    }
    return names;
}

// the context options from {name: value} (specee_context_option's names; None: the default); ValueError naming a
// refused value or an unknown name
static specee_context_options context_options_of(const py::dict & values) {
    specee_context_options o = specee_context_options_default();
    for (const auto & [k, v] : values) {
        if (specee_context_options_set(&o, py::str(k).cast<std::string>().c_str(),
                                       option_text(py::reinterpret_borrow<py::object>(v)).c_str()) != 0) {
            throw py::value_error(specee_last_error());
        }
    }
    return o;
}

struct Model {
    specee_model *              ptr = nullptr;
    std::vector<specee_lora *>  lora;        // the adapters of the options lora / lora_scaled, in order
    std::vector<float>          lora_scales; // the scales a new context applies them at

    explicit Model(const py::dict & options) {
        const specee_context_options o = context_options_of(options);
        int32_t                      n = 0;
        lora.resize(SPECEE_LORA_MAX);
        lora_scales.resize(SPECEE_LORA_MAX);
        {
            py::gil_scoped_release release;
            ptr = specee_model_load(o.model, specee_context_options_model_params(&o));
            n   = ptr ? specee_lora_init_from_options(ptr, &o, lora.data(), lora_scales.data(), SPECEE_LORA_MAX) : 0;
        }
        if (!ptr || n < 0) {
            const std::string why = specee_last_error();
            specee_model_free(ptr);
            PyObject * msg = PyUnicode_DecodeUTF8(why.data(), (Py_ssize_t) why.size(), "replace"); // file bytes
            PyErr_SetObject(g_error, msg);
            Py_XDECREF(msg);
            throw py::error_already_set();
        }
        lora.resize(n);
        lora_scales.resize(n);
    }
    ~Model() {
        for (specee_lora * a : lora) {
            specee_lora_free(a);
        }
        specee_model_free(ptr);
    }

    py::dict metadata() const {
        py::dict d;
        for (int32_t i = 0; i < specee_model_meta_count(ptr); ++i) {
            d[py::str(specee_model_meta_key(ptr, i))] =
                py::reinterpret_steal<py::object>(PyUnicode_DecodeUTF8(specee_model_meta_value(ptr, i),
                    (Py_ssize_t) strlen(specee_model_meta_value(ptr, i)), "replace"));
        }
        return d;
    }
};

struct Context {
    py::object       model_ref; // keeps the model alive
    specee_model *   model = nullptr;
    specee_context * ptr   = nullptr;

    Context(py::object model_obj, const py::dict & options) : model_ref(model_obj) {
        model                          = model_obj.cast<Model &>().ptr;
        const specee_context_options o = context_options_of(options);
        const specee_context_params  p = specee_context_options_context_params(&o);
        ptr                            = specee_context_init(model, p);
        if (!ptr) {
            raise_last();
        }
        const Model & mo = model_obj.cast<Model &>();
        set_lora(mo.lora_scales);
    }
    ~Context() { specee_context_free(ptr); }

    // the model's LoRA adapters at these scales, one per adapter in order
    void set_lora(const std::vector<float> & scales) {
        const Model & mo = model_ref.cast<Model &>();
        if (scales.size() != mo.lora.size()) {
            throw py::value_error("set_lora takes one scale per LoRA adapter of the model (" +
                                  std::to_string(mo.lora.size()) + ")");
        }
        if (specee_context_set_lora(ptr, mo.lora.data(), scales.data(), (int32_t) scales.size()) != 0) {
            throw py::value_error(specee_last_error());
        }
    }

    std::vector<float> lora_scales() const {
        std::vector<float> out(specee_context_n_lora(ptr));
        for (size_t i = 0; i < out.size(); ++i) {
            specee_context_lora(ptr, (int32_t) i, &out[i]);
        }
        return out;
    }

    py::array_t<float> logits() const {
        const int32_t n_out   = specee_n_outputs(ptr);
        const int32_t n_vocab = specee_model_n_vocab(model);
        py::array_t<float> out({n_out, n_vocab});
        if (n_out > 0) {
            memcpy(out.mutable_data(), specee_get_logits(ptr), sizeof(float) * n_out * n_vocab);
        }
        return out;
    }

    py::array_t<float> run(const i32_array & tokens, const std::optional<i32_array> & pos,
                           const std::optional<u8_array> & tree_mask, const std::optional<i8_array> & output,
                           int32_t l0, int32_t l1, uint32_t flags, bool all_layers,
                           const std::optional<i32_array> & seq_id) {
        const int32_t n = (int32_t) tokens.size();
        if (seq_id && (int32_t) seq_id->size() != n) {
            throw py::value_error("seq_id must have one entry per token");
        }
        if (pos && (int32_t) pos->size() != n) {
            throw py::value_error("pos must have one entry per token");
        }
        if (tree_mask && (int32_t) tree_mask->size() != n * n) {
            throw py::value_error("tree_mask must be [n_tokens, n_tokens]");
        }
        if (output && (int32_t) output->size() != n) {
            throw py::value_error("output must have one entry per token");
        }
        specee_batch b = {n, tokens.data(), pos ? pos->data() : nullptr, tree_mask ? tree_mask->data() : nullptr,
                          output ? output->data() : nullptr, seq_id ? seq_id->data() : nullptr};
        int32_t      rc;
        {
            py::gil_scoped_release release;
            rc = all_layers ? specee_eval(ptr, &b) : specee_eval_layers(ptr, &b, l0, l1, flags);
        }
        if (rc != 0) {
            raise_last();
        }
        return logits();
    }

    py::array_t<float> hidden_copy(const float * data) const {
        if (!data) {
            raise_last();
        }
        const int32_t n      = specee_last_n_tokens(ptr);
        const int32_t n_embd = specee_model_n_embd(model);
        py::array_t<float> out({n, n_embd});
        memcpy(out.mutable_data(), data, sizeof(float) * n * n_embd);
        return out;
    }

    // texts' token ids one after another, n_tokens[i] each -> [n_texts, n_out] ([n_texts, 1] for rank), or the
    // texts' token rows one after another [n_tokens total, n_embd] for pooling none
    py::array_t<float> embed(const i32_array & tokens, const i32_array & n_tokens, int32_t pooling, bool normalize) {
        const int32_t n_seqs = (int32_t) n_tokens.size();
        int64_t       total = 0, n_floats = 0;
        for (int32_t i = 0; i < n_seqs; ++i) {
            total += n_tokens.data()[i];
            n_floats += std::max(specee_pooling_n_out(model, pooling, n_tokens.data()[i]), 0);
        }
        if (total != (int64_t) tokens.size()) {
            throw py::value_error("n_tokens must add up to the number of tokens");
        }
        const int32_t      n_out = std::max(specee_pooling_n_out(model, pooling, 1), 1); // a row's floats
        py::array_t<float> out({(int64_t) (n_floats / n_out), (int64_t) n_out});
        int32_t            rc;
        {
            py::gil_scoped_release release;
            rc = specee_embed(ptr, tokens.data(), n_tokens.data(), n_seqs, pooling, normalize, out.mutable_data());
        }
        if (rc != 0) {
            raise_last();
        }
        return out;
    }
};

using f32_array = py::array_t<float, py::array::c_style | py::array::forcecast>;

struct Sampler {
    specee_sampler * ptr = nullptr;

    Sampler(float temp, int32_t top_k, float top_p, float min_p, float repeat_penalty, int32_t repeat_last_n,
            std::optional<int64_t> seed) {
        if (seed && (*seed < -1 || *seed > (int64_t) UINT32_MAX)) {
            throw py::value_error("seed must be -1 (random) or in 0..2**32-1, not " + std::to_string(*seed));
        }
        specee_sampler_params p = specee_sampler_default_params();
        p.temp                  = temp;
        p.top_k                 = top_k;
        p.top_p                 = top_p;
        p.min_p                 = min_p;
        p.repeat_penalty        = repeat_penalty;
        p.repeat_last_n         = repeat_last_n;
        p.seed                  = seed && *seed >= 0 ? (uint32_t) *seed : SPECEE_DEFAULT_SEED;
        ptr                     = specee_sampler_init(p);
        if (!ptr) {
            raise_last();
        }
    }
    Sampler(const Sampler &)             = delete;
    Sampler & operator=(const Sampler &) = delete;
    ~Sampler() { specee_sampler_free(ptr); }

    int32_t sample(const f32_array & logits) {
        if (logits.ndim() != 1) {
            throw py::value_error("logits must be a 1-D array [n_vocab]");
        }
        const int32_t id = specee_sampler_sample(ptr, logits.data(), (int32_t) logits.size());
        if (id < 0) {
            raise_last();
        }
        return id;
    }

    py::array_t<float> probs(const f32_array & logits) {
        if (logits.ndim() != 1) {
            throw py::value_error("logits must be a 1-D array [n_vocab]");
        }
        py::array_t<float> out(logits.size());
        if (specee_sampler_probs(ptr, logits.data(), (int32_t) logits.size(), out.mutable_data()) != 0) {
            raise_last();
        }
        return out;
    }
};

// ---- the generator: its parameters are read off a Python object by the option table's names
// (specee.generate.GenerateOptions: "temp", "eagle.topk" is options.eagle.topk, ...), each as text, so the library
// checks every value (specee_generator_params_set)

// an option's value as the text specee_generator_params_set reads: None -> "" (the default), bools, numbers,
// sequences of integers "16,20,24"
static std::string option_text(const py::object & v) {
    if (v.is_none()) {
        return "";
    }
    if (py::isinstance<py::bool_>(v)) {
        return v.cast<bool>() ? "true" : "false";
    }
    if (py::isinstance<py::str>(v)) {
        return v.cast<std::string>();
    }
    if (py::isinstance<py::float_>(v) || py::isinstance<py::int_>(v)) {
        return py::repr(v).cast<std::string>();
    }
    std::string s;
    for (const py::handle & x : v.cast<py::sequence>()) {
        s += (s.empty() ? "" : ",") + (py::isinstance<py::str>(x) ? x.cast<std::string>() : py::repr(x).cast<std::string>());
    }
    return s.empty() ? std::string(",") : s; // an empty list is not the default: refused
}

// group "": every option, read off o (GenerateOptions); "exit": the exit.* options, read off o (ExitParams).
// grammar: where o's grammar_spec ((type, text) or None: specee.grammar) is kept while the params point to it
static specee_generator_params params_of(const py::object & o, const std::string & group = "",
                                         std::string * grammar = nullptr) {
    specee_generator_params p = specee_generator_default_params();
    for (int32_t i = 0; const specee_option * opt = specee_generator_option(i); ++i) {
        std::string name = opt->name;
        if (!group.empty()) {
            if (name.compare(0, group.size() + 1, group + ".") != 0) {
                continue;
            }
            name = name.substr(group.size() + 1);
        }
        py::object v = o;
        for (size_t a = 0, b; a <= name.size(); a = b + 1) {
            b = std::min(name.find('.', a), name.size());
            v = v.attr(name.substr(a, b - a).c_str());
        }
        if (specee_generator_params_set(&p, opt->name, option_text(v).c_str()) != 0) {
            throw py::value_error(specee_last_error());
        }
    }
    if (grammar && py::hasattr(o, "grammar_spec")) {
        const py::object spec = o.attr("grammar_spec");
        if (!spec.is_none()) {
            const py::tuple t = spec.cast<py::tuple>();
            p.grammar_type    = t[0].cast<int32_t>();
            *grammar          = t[1].cast<std::string>();
            p.grammar         = grammar->c_str();
        }
    }
    return p;
}

static py::dict stats_dict(const specee_generator_stats & st) {
    py::dict d;
    for (int32_t i = 0; const char * name = specee_generator_stat_name(i); ++i) {
        const double v = specee_generator_stat_value(&st, i);
        d[name]        = name[0] == 'n' && name[1] == '_' ? py::object(py::int_((int64_t) v)) : py::object(py::float_(v));
    }
    return d;
}

struct Generator {
    py::object         ctx_ref; // keeps the context (and its model) alive
    specee_generator * ptr = nullptr;

    Generator(py::object ctx_obj, const py::object & options) : ctx_ref(ctx_obj) {
        std::string                   grammar;
        const specee_generator_params p = params_of(options, "", &grammar);
        {
            py::gil_scoped_release release; // a grammar compiles here
            ptr = specee_generator_init(ctx_obj.cast<Context &>().ptr, p);
        }
        if (!ptr) {
            raise_last();
        }
    }
    Generator(const Generator &)             = delete;
    Generator & operator=(const Generator &) = delete;
    ~Generator() { specee_generator_free(ptr); }

    void set_params(const py::object & options) {
        std::string                   grammar;
        const specee_generator_params p = params_of(options, "", &grammar);
        int32_t                       r;
        {
            py::gil_scoped_release release; // a grammar compiles here
            r = specee_generator_set_params(ptr, p);
        }
        if (r != 0) {
            raise_last();
        }
    }

    int32_t start(const i32_array & tokens) {
        int32_t reused;
        {
            py::gil_scoped_release release;
            reused = specee_generator_start(ptr, tokens.data(), (int32_t) tokens.size());
        }
        if (reused < 0) {
            raise_last();
        }
        return reused;
    }

    // (tokens, layers run per token); empty when the context is full. One step never yields more tokens than the
    // context has cells, so the buffers are sized by that, not by n_max (max_tokens of a whole generation)
    py::tuple next(int32_t n_max) {
        const int32_t cap = std::max(1, (int32_t) std::min<int64_t>(n_max, specee_n_ctx(ctx_ref.cast<Context &>().ptr)));
        std::vector<int32_t> toks(cap), layers(cap);
        int32_t              n;
        {
            py::gil_scoped_release release;
            n = specee_generator_next(ptr, toks.data(), layers.data(), n_max <= 0 ? n_max : cap);
        }
        if (n < 0) {
            raise_last();
        }
        toks.resize(n);
        layers.resize(n);
        return py::make_tuple(toks, layers);
    }

    py::dict stats() const { return stats_dict(specee_generator_get_stats(ptr)); }
};

// a grammar driven by hand (specee.h, "grammars"): the constraint interface the sampler uses
struct Grammar {
    py::object       model_ref; // keeps the model alive
    specee_grammar * ptr = nullptr;

    Grammar(py::object model_obj, int32_t type, const std::string & text) : model_ref(model_obj) {
        const specee_model * m = model_obj.cast<Model &>().ptr;
        {
            py::gil_scoped_release release;
            ptr = specee_grammar_init(m, type, text.c_str());
        }
        if (!ptr) {
            raise_last();
        }
    }
    Grammar(const Grammar &)             = delete;
    Grammar & operator=(const Grammar &) = delete;
    ~Grammar() { specee_grammar_free(ptr); }

    py::array_t<uint32_t> mask() {
        const int32_t         n = specee_grammar_mask(ptr, nullptr, 0);
        py::array_t<uint32_t> out(std::max(n, 0));
        if (n < 0 || specee_grammar_mask(ptr, out.mutable_data(), n) < 0) {
            raise_last();
        }
        return out;
    }
    void accept(int32_t token) {
        if (specee_grammar_accept(ptr, token) != 0) {
            raise_last();
        }
    }
    void rollback(int32_t n) {
        if (specee_grammar_rollback(ptr, n) != 0) {
            raise_last();
        }
    }
    int32_t valid_prefix(const std::vector<int32_t> & tokens) {
        const int32_t n = specee_grammar_valid_prefix(ptr, tokens.data(), (int32_t) tokens.size());
        if (n < 0) {
            raise_last();
        }
        return n;
    }
    std::vector<int32_t> forced(int32_t n_max) {
        std::vector<int32_t> out(std::max(n_max, 0));
        const int32_t        n = specee_grammar_forced_tokens(ptr, out.data(), n_max);
        if (n < 0) {
            raise_last();
        }
        out.resize(n);
        return out;
    }
};

// parallel slots over a context (specee.h, "parallel slots"); the calls run without the GIL
struct Slots {
    py::object     ctx_ref; // keeps the context (and its model) alive
    specee_slots * ptr    = nullptr;
    specee_model * model  = nullptr;
    int32_t        n_embd = 0;

    Slots(py::object ctx_obj, int32_t n_slots, int32_t n_chunk) : ctx_ref(ctx_obj) {
        Context & c = ctx_obj.cast<Context &>();
        ptr         = specee_slots_init(c.ptr, n_slots, n_chunk);
        if (!ptr) {
            raise_last();
        }
        model  = c.model;
        n_embd = specee_model_n_embd(c.model);
    }
    Slots(const Slots &)             = delete;
    Slots & operator=(const Slots &) = delete;
    ~Slots() { specee_slots_free(ptr); }

    // the slot, or SLOTS_BUSY when every slot holds a request
    // (slot >= 0: on that slot, SLOTS_BUSY while it holds a request)
    int32_t submit(const i32_array & tokens, const py::object & options, int32_t n_predict, int32_t n_probs,
                   int32_t slot) {
        std::string                   grammar;
        const specee_generator_params p = params_of(options, "", &grammar);
        int32_t                       r;
        {
            py::gil_scoped_release release;
            r = slot < 0 ? specee_slots_submit(ptr, tokens.data(), (int32_t) tokens.size(), p, n_predict, n_probs)
                         : specee_slots_submit_to(ptr, slot, tokens.data(), (int32_t) tokens.size(), p, n_predict,
                                                  n_probs);
        }
        if (r == -1) {
            raise_last();
        }
        return r;
    }

    int32_t step() {
        int32_t r;
        {
            py::gil_scoped_release release;
            r = specee_slots_step(ptr);
        }
        if (r < 0) {
            raise_last();
        }
        return r;
    }

    // (tokens, layers run per token, finish reason, error message, log-probabilities: per token a list of
    // (token, logprob), the token itself first then the n_probs most likely; empty without n_probs); read and release
    // keep the GIL: they are quick, and handing the GIL to another thread and back costs a switch interval
    py::tuple read(int32_t slot) {
        const int32_t                     n_probs = specee_slots_n_probs(ptr, slot);
        const int32_t                     n_max   = n_probs >= 0 ? 256 : 4096; // the rest at the next read
        int32_t                           finish  = 0;
        std::vector<int32_t>              toks(n_max), layers(n_max);
        std::vector<specee_token_logprob> probs(n_probs >= 0 ? (size_t) n_max * (1 + n_probs) : 0);
        const int32_t n = specee_slots_read(ptr, slot, toks.data(), layers.data(), probs.empty() ? nullptr : probs.data(),
                                            n_max, &finish);
        if (n < 0) {
            raise_last();
        }
        toks.resize(n);
        layers.resize(n);
        py::list logprobs;
        for (int32_t i = 0; i < n && n_probs >= 0; ++i) {
            py::list row;
            for (int32_t k = 0; k <= n_probs; ++k) {
                const specee_token_logprob & e = probs[(size_t) i * (1 + n_probs) + k];
                if (e.token >= 0) { // (-1: fewer alternatives kept by the sampler's chain, post_sampling_probs)
                    row.append(py::make_tuple(e.token, e.logprob));
                }
            }
            logprobs.append(row);
        }
        return py::make_tuple(toks, layers, finish, std::string(specee_slots_error(ptr, slot)), logprobs);
    }

    int32_t set_unified(bool unified) {
        const int32_t r = specee_slots_set_unified(ptr, unified ? 1 : 0);
        if (r < 0) {
            raise_last();
        }
        return r;
    }

    // a free slot's cache to a file, back, or dropped (specee.h): the cells; the GIL released for the I/O
    int32_t cache(const std::string & action, int32_t slot, const std::string & path) {
        int32_t r;
        {
            py::gil_scoped_release release;
            r = action == "save"      ? specee_slots_save(ptr, slot, path.c_str())
                : action == "restore" ? specee_slots_restore(ptr, slot, path.c_str())
                                      : specee_slots_erase(ptr, slot);
        }
        if (r < 0) {
            raise_last();
        }
        return r;
    }

    // a free slot's cells as bytes in memory (specee_slots_save_mem), and back into a free slot: the cells
    py::bytes save_mem(int32_t slot) {
        std::string bytes;
        int64_t     n;
        {
            py::gil_scoped_release release;
            n = specee_slots_save_mem(ptr, slot, nullptr, 0);
            if (n >= 0) {
                bytes.resize((size_t) n);
                n = specee_slots_save_mem(ptr, slot, (uint8_t *) bytes.data(), n);
            }
        }
        if (n < 0) {
            raise_last();
        }
        return py::bytes(bytes);
    }
    int32_t restore_mem(int32_t slot, const py::bytes & bytes) {
        const std::string_view view = bytes;
        int32_t                r;
        {
            py::gil_scoped_release release;
            r = specee_slots_restore_mem(ptr, slot, (const uint8_t *) view.data(), (int64_t) view.size());
        }
        if (r < 0) {
            raise_last();
        }
        return r;
    }

    // the tokens a slot's cache holds, in position order
    std::vector<int32_t> cache_tokens(int32_t slot) {
        const int32_t n = specee_slots_cache_tokens(ptr, slot, nullptr, 0);
        if (n < 0) {
            raise_last();
        }
        std::vector<int32_t> out(n);
        out.resize(std::max(0, std::min(n, specee_slots_cache_tokens(ptr, slot, out.data(), n))));
        return out;
    }

    // (the slot submit would give the prompt now, the prefix its cache holds); None when every slot is busy
    py::object choose(const i32_array & tokens) {
        int32_t cached = 0;
        const int32_t r = specee_slots_choose(ptr, tokens.data(), (int32_t) tokens.size(), &cached);
        if (r == SPECEE_SLOTS_BUSY) {
            return py::none();
        }
        return py::make_tuple(r, cached);
    }

    void release(int32_t slot) {
        if (specee_slots_release(ptr, slot) != 0) {
            raise_last();
        }
    }

    py::dict totals() const {
        const specee_slots_totals t = specee_slots_get_totals(ptr);
        py::dict                  d;
        d["n_requests"]    = t.n_requests;
        d["n_cancelled"]   = t.n_cancelled;
        d["n_tokens"]      = t.n_tokens;
        d["n_passes"]      = t.n_passes;
        d["n_pass_tokens"] = t.n_pass_tokens;
        d["t_pass_ms"]     = t.t_pass_ms;
        return d;
    }

    // [n_out] ([1] for rank), or [n_tokens, n_embd] for pooling none
    py::array_t<float> embed(const i32_array & tokens, int32_t pooling) {
        const int32_t      n     = (int32_t) tokens.size();
        const bool         rows = (pooling < 0 ? specee_model_pooling(model) : pooling) == SPECEE_POOLING_NONE;
        py::array_t<float> out  = rows ? py::array_t<float>({(int64_t) n, (int64_t) n_embd})
                                       : py::array_t<float>(std::max(specee_pooling_n_out(model, pooling, n), 1));
        float *            data = out.mutable_data();
        int32_t            r;
        {
            py::gil_scoped_release release;
            r = specee_slots_embed(ptr, tokens.data(), n, pooling, data);
        }
        if (r != 0) {
            raise_last();
        }
        return out;
    }
};

// {"role": ..., "content": ...} dicts as the C API's messages (pointing into the dicts)
static std::vector<specee_chat_message> chat_messages(const std::vector<std::map<std::string, std::string>> & messages) {
    std::vector<specee_chat_message> msgs;
    for (const auto & msg : messages) {
        const auto role = msg.find("role"), content = msg.find("content");
        if (role == msg.end() || content == msg.end()) {
            throw py::value_error("each message needs a 'role' and a 'content'");
        }
        msgs.push_back({role->second.c_str(), content->second.c_str()});
    }
    return msgs;
}

// {name: value as text} of every option of a table (the generation or the context options), read off p
template <typename P>
static py::dict option_values(const specee_option * (*option)(int32_t),
                              int32_t (*get)(const P *, const char *, char *, int32_t), const P & p) {
    py::dict d;
    for (int32_t i = 0; const specee_option * o = option(i); ++i) {
        char buf[SPECEE_MAX_CHOICES];
        get(&p, o->name, buf, sizeof(buf));
        d[o->name] = buf;
    }
    return d;
}

// a table's rows (name, type, choices, expect, help, default as text, flags, hint); d: the defaults
template <typename P>
static py::list option_rows(const specee_option * (*option)(int32_t),
                            int32_t (*get)(const P *, const char *, char *, int32_t), const P & d) {
    const py::dict defaults = option_values(option, get, d);
    py::list       out;
    for (int32_t i = 0; const specee_option * o = option(i); ++i) {
        py::dict e;
        e["name"] = o->name, e["type"] = o->type, e["expect"] = o->expect, e["help"] = o->help;
        e["default"] = defaults[o->name];
        e["choices"] = o->choices ? py::object(py::str(o->choices).attr("split")(",")) : py::object(py::list());
        e["flags"]   = py::str(o->flags).attr("split")(","); // every row has its spellings
        e["hint"]    = o->hint ? py::object(py::str(o->hint)) : py::object(py::none());
        e["repeatable"] = o->repeatable;
        out.append(e);
    }
    return out;
}

PYBIND11_MODULE(_core, m) {
    m.doc() = "SpecEE native runtime (see csrc/include/specee.h)";
    specee_log_set_verbose(false);

    static py::exception<std::runtime_error> error(m, "SpecEEError", PyExc_RuntimeError);
    g_error = error.ptr();

    m.attr("SLOTS_BUSY")      = (int) SPECEE_SLOTS_BUSY;
    m.attr("MAX_PROBS")       = (int) SPECEE_MAX_PROBS;
    m.attr("FINISH_NONE")     = (int) SPECEE_FINISH_NONE;
    m.attr("FINISH_STOP")     = (int) SPECEE_FINISH_STOP;
    m.attr("FINISH_LENGTH")   = (int) SPECEE_FINISH_LENGTH;
    m.attr("FINISH_CONTEXT")  = (int) SPECEE_FINISH_CONTEXT;
    m.attr("FINISH_ERROR")    = (int) SPECEE_FINISH_ERROR;
    m.attr("MAX_SEQ")         = (int) SPECEE_MAX_SEQ;
    m.attr("EVAL_HIDDEN_ALL") = (int) SPECEE_EVAL_HIDDEN_ALL;
    m.attr("EVAL_NO_LOGITS")  = (int) SPECEE_EVAL_NO_LOGITS;


    m.def("set_verbose", &specee_log_set_verbose);
    m.def("generator_options", [] {
        return option_rows(specee_generator_option, specee_generator_params_get, specee_generator_default_params());
    }, "the generation options (name, type, choices, expect, help, default as text), the library's table");
    m.def("context_options", [] {
        return option_rows(specee_context_option, specee_context_options_get, specee_context_options_default());
    }, "the context options (name, type, choices, expect, help, default as text, flags, hint), the library's table");
    m.def("context_options_values", [](const py::dict & values) {
        return option_values(specee_context_option, specee_context_options_get, context_options_of(values));
    }, py::arg("values"), "the context options as the library reads {name: value} ({name: text}); ValueError when one "
                          "is refused");
    m.def("poolings", [] {
        py::list out;
        for (int32_t i = 0; const specee_pooling_info * pi = specee_pooling_row(i); ++i) {
            py::dict e;
            e["name"] = pi->name, e["help"] = pi->help, e["normalized"] = pi->normalized;
            out.append(e);
        }
        return out;
    }, "the poolings of embeddings (name, help, normalized), in enum specee_pooling's order: the library's table");
    m.def("modes", [] {
        py::list out;
        for (int32_t i = 0; const specee_mode_info * mi = specee_mode_row(i); ++i) {
            py::dict e;
            e["name"] = mi->name, e["help"] = mi->help, e["needs_head"] = mi->needs_head, e["tree"] = mi->tree;
            e["exits"] = mi->exits, e["lossless"] = mi->lossless, e["shared_pass"] = mi->shared_pass;
            e["greedy_only"] = mi->greedy_only ? py::object(py::str(mi->greedy_only)) : py::object(py::none());
            py::list reads;
            for (const auto & [bit, what] : {std::pair<uint32_t, const char *>{SPECEE_READS_EAGLE1_TREE, "eagle1_tree"},
                                             {SPECEE_READS_EAGLE2_TREE, "eagle2_tree"}, {SPECEE_READS_EXIT, "exit"},
                                             {SPECEE_READS_NGRAM, "ngram"}, {SPECEE_READS_DRAFT, "draft"}}) {
                if (mi->reads & bit) {
                    reads.append(what);
                }
            }
            e["reads"] = reads;
            out.append(e);
        }
        return out;
    }, "the mode table (name, help, needs_head, tree, exits, lossless, shared_pass, greedy_only, reads), by enum "
       "specee_mode");
    m.def("spec_types", [] {
        py::dict out;
        for (int32_t i = 0; const specee_spec_type * st = specee_spec_type_row(i); ++i) {
            out[st->name] = specee_mode_name(st->mode);
        }
        return out;
    }, "llama.cpp's speculation types (--spec-type) and the mode that serves each here: the library's table");
    m.def("generate_options_values", [](const py::object & o, const std::string & group) {
        return option_values(specee_generator_option, specee_generator_params_get, params_of(o, group));
    }, py::arg("options"), py::arg("group") = "",
       "the options' values as the library reads them ({name: text}); ValueError when one is refused (the library's "
       "checks); group 'eagle', 'exit', 'ngram' or 'draft': only those, read off EagleParams / ExitParams / "
       "NgramParams / DraftParams");
    m.def("generator_stat_names", [] {
        py::list out;
        for (int32_t i = 0; const char * n = specee_generator_stat_name(i); ++i) {
            out.append(n);
        }
        return out;
    });
    m.def("max_threads", &specee_max_threads);
    m.def("arch_eagle_tensor_names", [] { return name_list(specee_arch_eagle_tensor_name); });
    m.def("quantize", [](int32_t type, const f32_array & rows, std::optional<f32_array> imatrix) {
        if (rows.ndim() != 2) {
            throw py::value_error("quantize: expected a 2-D array of rows");
        }
        const int64_t n_rows = rows.shape(0), n_per_row = rows.shape(1);
        if (imatrix && (imatrix->ndim() != 1 || imatrix->shape(0) != n_per_row)) {
            throw py::value_error("quantize: the importance matrix must hold one weight per column (" +
                                  std::to_string(n_per_row) + "), not " + std::to_string(imatrix->size()));
        }
        const float * weights = imatrix ? imatrix->data() : nullptr;
        const int64_t size    = specee_quantize(type, nullptr, nullptr, 1, n_per_row, weights); // one row's bytes
        if (size < 0) {
            raise_last();
        }
        py::array_t<uint8_t> out({(py::ssize_t) n_rows, (py::ssize_t) size});
        int64_t               n;
        {
            py::gil_scoped_release release;
            n = specee_quantize(type, rows.data(), out.mutable_data(), n_rows, n_per_row, weights);
        }
        if (n < 0) {
            raise_last();
        }
        return out;
    }, py::arg("type"), py::arg("rows"), py::arg("imatrix") = py::none(),
       "rows [n_rows, n_per_row] of floats as ggml type `type`: [n_rows, row bytes] uint8, as llama-quantize makes "
       "them; imatrix: None or [n_per_row] importance weights (an importance matrix's entry for the tensor)");
    m.def("kernels_mul_mat", [](const py::array_t<uint8_t, py::array::c_style> & w, int64_t k, const f32_array & x,
                                int32_t mode, int32_t n_threads, int32_t repeats, int32_t type, bool rows8) {
        if (w.ndim() != 2 || x.ndim() != 2 || x.shape(1) != k) {
            throw py::value_error("kernels_mul_mat: w [m, row bytes] uint8 and x [n, k] floats");
        }
        if (specee_kernels_type(type) && k % ggml_blck_size((ggml_type) type) == 0 &&
            (size_t) w.shape(1) != ggml_row_size((ggml_type) type, k)) {
            throw py::value_error("kernels_mul_mat: a row of w holds " + std::to_string(w.shape(1)) + " bytes, " +
                                  std::to_string(ggml_row_size((ggml_type) type, k)) + " expected");
        }
        const int64_t      m = w.shape(0), n = x.shape(0);
        py::array_t<float> out({(py::ssize_t) n, (py::ssize_t) m});
        double             s;
        {
            py::gil_scoped_release release;
            s = specee_kernels_mul_mat(type, w.data(), k, m, x.data(), n, mode, n_threads, repeats, rows8,
                                       out.mutable_data());
        }
        if (s < 0) {
            throw py::value_error("kernels_mul_mat: bad shapes");
        }
        return py::make_tuple(out, s);
    }, py::arg("w"), py::arg("k"), py::arg("x"), py::arg("mode"), py::arg("n_threads") = 1, py::arg("repeats") = 1,
       py::arg("type") = (int32_t) GGML_TYPE_Q4_1, py::arg("rows8") = false,
       "one matmul on ggml's CPU backend: the rows w [m, row bytes] of ggml type `type` (Q4_1, Q8_0, Q4_K, Q5_K or Q6_K, Q4_0 with rows8 or mode off; from "
       "quantize) times x [n, k] under kernels mode `mode` (0 auto, 1 portable, 2 off = ggml's mul_mat); rows8: a Q4_1 "
       "or Q4_K matrix of a multiple of 8 rows held in the loader's eight-row layout (the kernel whatever the mode): "
       "(out [n, m], the fastest of `repeats` computes in seconds)");
    m.def("kernels_auto_path", &specee_kernels_auto_path, "the path kernels=auto takes here: avx2 or off");
    m.def("kernels_int8_peak", [](int64_t iters) {
        py::gil_scoped_release release;
        return specee_kernels_int8_peak(iters);
    }, py::arg("iters") = 50000000,
       "this CPU's peak rate of the tiles' byte products on one thread, per second (vpmaddubsw chains; -1 without "
       "AVX2)");
    m.def("kernels_built", &specee_kernels_built, py::arg("type"),
          "how many weight products of ggml type `type` this process has built with the kernel so far");
    m.def("kernels_built_quantizations", &specee_kernels_built_quantizations,
          "how many quantizations of activations those products have built (an input read by several products, as "
          "Q, K and V, is quantized once)");
    m.def("vocab_pre_names", [] { return name_list(specee_vocab_pre_name); },
          "the tokenizer.ggml.pre names of the BPE pre-tokenizers this runtime has");
    m.def("arch_pred_tensor_names", [] { return name_list(specee_arch_pred_tensor_name); });
    m.def("arch_families", [] { return name_list(specee_arch_family_row); },
          "the model families' table, a row each: 'NAME ROPE TENSOR,TENSOR,...'");
    m.def("arch_tensor_names", [] { return name_list(specee_arch_tensor_name); });

    py::class_<Model>(m, "Model")
        .def(py::init<const py::dict &>(), py::arg("options"),
             "the model of the context options {name: value} (model: the file; the placement and draft_head options)")
        .def_property_readonly("placement", [](const Model & s) { return std::string(specee_model_placement(s.ptr)); })
        .def_property_readonly("n_layer", [](const Model & s) { return specee_model_n_layer(s.ptr); })
        .def_property_readonly("n_embd", [](const Model & s) { return specee_model_n_embd(s.ptr); })
        .def_property_readonly("n_ff", [](const Model & s) { return specee_model_n_ff(s.ptr); })
        .def_property_readonly("n_head", [](const Model & s) { return specee_model_n_head(s.ptr); })
        .def_property_readonly("n_head_kv", [](const Model & s) { return specee_model_n_head_kv(s.ptr); })
        .def_property_readonly("n_vocab", [](const Model & s) { return specee_model_n_vocab(s.ptr); })
        .def_property_readonly("n_ctx_train", [](const Model & s) { return specee_model_n_ctx_train(s.ptr); })
        .def_property_readonly("n_params", [](const Model & s) { return specee_model_n_params(s.ptr); })
        .def_property_readonly("size", [](const Model & s) { return specee_model_size(s.ptr); })
        .def_property_readonly("desc", [](const Model & s) { return std::string(specee_model_desc(s.ptr)); })
        .def_property_readonly("pooling", [](const Model & s) { return specee_model_pooling(s.ptr); })
        .def("metadata", &Model::metadata)
        .def("lora_adapters",
             [](const Model & s) {
                 py::list out;
                 for (specee_lora * a : s.lora) {
                     py::dict d;
                     d["path"]      = std::string(specee_lora_path(a));
                     d["alpha"]     = specee_lora_alpha(a);
                     d["n_weights"] = specee_lora_n_weights(a);
                     out.append(d);
                 }
                 return out;
             },
             "the LoRA adapters of the options lora / lora_scaled, in order: {path, alpha, n_weights}")
        .def("tokenize",
             [](const Model & s, const std::string & text, bool add_special, bool parse_special) {
                 std::vector<int32_t> ids(text.size() + 2);
                 int32_t              n;
                 {
                     py::gil_scoped_release release;
                     n = specee_tokenize(s.ptr, text.data(), (int32_t) text.size(), ids.data(), (int32_t) ids.size(),
                                         add_special, parse_special);
                     if (n < 0 && n != INT32_MIN) {
                         ids.resize(-n);
                         n = specee_tokenize(s.ptr, text.data(), (int32_t) text.size(), ids.data(),
                                             (int32_t) ids.size(), add_special, parse_special);
                     }
                 }
                 if (n < 0) {
                     raise_last();
                 }
                 ids.resize(n);
                 return ids;
             },
             py::arg("text"), py::arg("add_special") = true, py::arg("parse_special") = false)
        .def("detokenize",
             [](const Model & s, const std::vector<int32_t> & tokens, bool remove_special, bool unparse_special) {
                 std::string text(tokens.size() * 8 + 16, '\0');
                 int32_t     n;
                 {
                     py::gil_scoped_release release; // a long list is a long loop: the server's other threads go on
                     n = specee_detokenize(s.ptr, tokens.data(), (int32_t) tokens.size(), text.data(),
                                           (int32_t) text.size(), remove_special, unparse_special);
                     if (n < 0 && n != INT32_MIN) {
                         text.resize(-n);
                         n = specee_detokenize(s.ptr, tokens.data(), (int32_t) tokens.size(), text.data(),
                                               (int32_t) text.size(), remove_special, unparse_special);
                     }
                 }
                 if (n < 0) {
                     raise_last();
                 }
                 return py::reinterpret_steal<py::str>(PyUnicode_DecodeUTF8(text.data(), n, "replace"));
             },
             py::arg("tokens"), py::arg("remove_special") = false, py::arg("unparse_special") = false)
        .def("token_to_piece",
             [](const Model & s, int32_t token, bool special) {
                 char    buf[64];
                 int32_t n = specee_token_to_piece(s.ptr, token, buf, sizeof(buf), special);
                 if (n == INT32_MIN) {
                     raise_last();
                 }
                 if (n < 0) {
                     std::string big(-n, '\0');
                     specee_token_to_piece(s.ptr, token, big.data(), -n, special);
                     return py::bytes(big);
                 }
                 return py::bytes(buf, n);
             },
             py::arg("token"), py::arg("special") = false)
        .def_property_readonly("token_bos", [](const Model & s) { return specee_token_bos(s.ptr); })
        .def_property_readonly("token_eos", [](const Model & s) { return specee_token_eos(s.ptr); })
        .def_property_readonly("token_eot", [](const Model & s) { return specee_token_eot(s.ptr); })
        .def("token_is_eog", [](const Model & s, int32_t t) { return specee_token_is_eog(s.ptr, t); })
        .def_property_readonly("eog_tokens", [](const Model & s) { return id_list(specee_token_eog_ids, s.ptr); })
        .def_property_readonly("fim_tokens",
                               [](const Model & s) {
                                   py::dict out; // name -> token id (-1: none), in specee.h's order
                                   for (int32_t k = 0; k < SPECEE_FIM_COUNT; ++k) {
                                       out[specee_fim_name(k)] = specee_token_fim(s.ptr, k);
                                   }
                                   return out;
                               })
        .def_property_readonly("has_eagle", [](const Model & s) { return specee_model_has_eagle(s.ptr); })
        .def_property_readonly("eagle_n_vocab", [](const Model & s) { return specee_model_eagle_n_vocab(s.ptr); })
        .def_property_readonly("eagle_draft_vocab",
                               [](const Model & s) -> std::optional<std::vector<int32_t>> {
                                   const int32_t * ids = specee_model_eagle_draft_vocab(s.ptr);
                                   if (!ids) {
                                       return std::nullopt;
                                   }
                                   return std::vector<int32_t>(ids, ids + specee_model_eagle_n_vocab(s.ptr));
                               })
        .def_property_readonly("eagle_version", [](const Model & s) { return specee_model_eagle_version(s.ptr); })
        .def_property_readonly("eagle_n_feature", [](const Model & s) { return specee_model_eagle_n_feature(s.ptr); })
        .def_property_readonly("eagle_feature_layers",
                               [](const Model & s) { return id_list(specee_model_eagle_feature_layers, s.ptr); })
        .def_property_readonly("exit_n_pred", [](const Model & s) { return specee_model_exit_n_pred(s.ptr); })
        .def("exit_has_pred", [](const Model & s, int32_t il) { return specee_model_exit_has_pred(s.ptr, il); })
        .def_property_readonly("exit_layers", [](const Model & s) { return id_list(specee_model_exit_layers, s.ptr); })
        .def_property_readonly("exit_threshold", [](const Model & s) { return specee_model_exit_threshold(s.ptr); })
        .def_property_readonly("exit_n_candidates",
                               [](const Model & s) { return specee_model_exit_n_candidates(s.ptr); })
        .def("exit_features",
             [](const Model & s, py::array_t<float, py::array::c_style | py::array::forcecast> h,
                py::array_t<int32_t, py::array::c_style | py::array::forcecast> cand,
                std::optional<py::array_t<float, py::array::c_style | py::array::forcecast>> p_prev) {
                 const int32_t n_cand = specee_model_exit_n_candidates(s.ptr);
                 if (h.size() != specee_model_n_embd(s.ptr) || cand.size() != n_cand ||
                     (p_prev && p_prev->size() != n_cand)) {
                     throw py::value_error("exit_features: h must have n_embd values, cand and p_prev n_candidates");
                 }
                 py::array_t<float> feat(3 * n_cand), p(n_cand);
                 if (specee_exit_features(s.ptr, h.data(), cand.data(), p_prev ? p_prev->data() : nullptr,
                                          feat.mutable_data(), p.mutable_data()) != 0) {
                     raise_last();
                 }
                 return py::make_tuple(feat, p);
             },
             py::arg("h"), py::arg("cand"), py::arg("p_prev") = py::none())
        .def("exit_predict",
             [](const Model & s, int32_t layer, py::array_t<float, py::array::c_style | py::array::forcecast> feat) {
                 if (feat.size() != 3 * specee_model_exit_n_candidates(s.ptr)) {
                     throw py::value_error("exit_predict: feat must have 3 * n_candidates values");
                 }
                 const float p = specee_exit_predict(s.ptr, layer, feat.data());
                 if (p < 0.0f) {
                     raise_last();
                 }
                 return p;
             },
             py::arg("layer"), py::arg("feat"))
        .def("load_eagle",
             [](Model & s, const std::string & path) {
                 if (specee_model_load_eagle(s.ptr, path.c_str()) != 0) {
                     raise_last();
                 }
             },
             py::arg("path"));

    py::class_<Context>(m, "Context")
        .def(py::init<py::object, const py::dict &>(), py::arg("model"), py::arg("options"),
             "a context of the context options {name: value} (n_ctx, n_batch, n_ubatch, n_threads, ...)")
        .def_property_readonly("n_ctx", [](const Context & s) { return specee_n_ctx(s.ptr); })
        .def_property_readonly("n_batch", [](const Context & s) { return specee_n_batch(s.ptr); })
        .def_property_readonly("n_threads", [](const Context & s) { return specee_n_threads(s.ptr); })
        .def_property_readonly("kv_nbytes", [](const Context & s) { return specee_kv_nbytes(s.ptr); })
        .def("eval",
             [](Context & s, const i32_array & tokens, const std::optional<i32_array> & pos,
                const std::optional<u8_array> & tree_mask, const std::optional<i8_array> & output,
                const std::optional<i32_array> & seq_id) {
                 return s.run(tokens, pos, tree_mask, output, 0, 0, 0, true, seq_id);
             },
             py::arg("tokens"), py::arg("pos") = py::none(), py::arg("tree_mask") = py::none(),
             py::arg("output") = py::none(), py::arg("seq_id") = py::none())
        .def("eval_layers", &Context::run, py::arg("tokens"), py::arg("pos"), py::arg("tree_mask"),
             py::arg("output"), py::arg("layer_begin"), py::arg("layer_end"), py::arg("flags") = 0,
             py::arg("all_layers") = false, py::arg("seq_id") = py::none())
        .def("logits", &Context::logits)
        .def("set_lora", &Context::set_lora, py::arg("scales"),
             "apply the model's LoRA adapters at these scales (one per adapter; 0: not applied)")
        .def("lora_scales", &Context::lora_scales)
        .def("hidden", [](const Context & s, int32_t il) { return s.hidden_copy(specee_get_hidden(s.ptr, il)); },
             py::arg("layer") = -1)
        .def("norm", [](const Context & s) { return s.hidden_copy(specee_get_norm(s.ptr)); })
        .def("features",
             [](const Context & s) {
                 const float * data = specee_get_features(s.ptr);
                 if (!data) {
                     raise_last();
                 }
                 const int32_t      n = specee_last_n_tokens(s.ptr), width = specee_model_eagle_n_feature(s.model);
                 py::array_t<float> out({n, width});
                 memcpy(out.mutable_data(), data, sizeof(float) * n * width);
                 return out;
             })
        .def("set_capture",
             [](Context & s, const std::vector<std::string> & names) {
                 std::vector<const char *> ptrs;
                 for (const std::string & n : names) {
                     ptrs.push_back(n.c_str());
                 }
                 if (specee_set_capture(s.ptr, ptrs.data(), (int32_t) ptrs.size()) != 0) {
                     raise_last();
                 }
             },
             py::arg("names"))
        .def("get_capture",
             [](const Context & s, const std::string & name) {
                 int64_t       ne0 = 0, rows = 0;
                 const float * data = specee_get_capture(s.ptr, name.c_str(), &ne0, &rows);
                 if (!data) {
                     raise_last();
                 }
                 py::array_t<float> out({rows, ne0});
                 memcpy(out.mutable_data(), data, sizeof(float) * ne0 * rows);
                 return out;
             },
             py::arg("name"))
        .def("kv_clear", [](Context & s) { specee_kv_clear(s.ptr); })
        .def("kv_remove", [](Context & s, int32_t p0, int32_t p1) { return specee_kv_remove(s.ptr, p0, p1); },
             py::arg("p0"), py::arg("p1") = -1)
        .def("kv_remove_cells",
             [](Context & s, const i32_array & cells) {
                 return specee_kv_remove_cells(s.ptr, cells.data(), (int32_t) cells.size());
             })
        .def("kv_batch_cells",
             [](const Context & s) {
                 const int32_t      n = specee_last_n_tokens(s.ptr);
                 py::array_t<int32_t> out(n);
                 if (n > 0) {
                     memcpy(out.mutable_data(), specee_kv_batch_cells(s.ptr), sizeof(int32_t) * n);
                 }
                 return out;
             })
        .def("kv_pos_max", [](const Context & s) { return specee_kv_pos_max(s.ptr); })
        .def("kv_n_used", [](const Context & s) { return specee_kv_n_used(s.ptr); })
        .def("ngram_cache_info",
             [](const Context & s) {
                 const specee_ngram_cache_info i = specee_ngram_cache_get_info(s.ptr);
                 py::dict                      d;
                 d["capacity"]  = i.capacity;
                 d["n_tokens"]  = i.n_tokens;
                 d["n_entries"] = i.n_entries;
                 d["n_docs"]    = i.n_docs;
                 d["n_added"]   = i.n_added;
                 return d;
             })
        .def("ngram_cache_clear", [](Context & s) { specee_ngram_cache_clear(s.ptr); })
        .def("set_pass_cost",
             [](Context & s, int32_t n_tokens, double cost) {
                 if (specee_context_set_pass_cost(s.ptr, n_tokens, cost) != 0) {
                     throw py::value_error(specee_last_error());
                 }
             },
             py::arg("n_tokens"), py::arg("cost"))
        .def("kv_cell_pos", [](const Context & s, int32_t c) { return specee_kv_cell_pos(s.ptr, c); })
        .def("kv_cell_valid",
             [](const Context & s, int32_t c, int32_t il) { return specee_kv_cell_valid(s.ptr, c, il); })
        .def("kv_seq_remove",
             [](Context & s, int32_t seq, int32_t p0, int32_t p1) {
                 const int32_t n = specee_kv_seq_remove(s.ptr, seq, p0, p1);
                 if (n < 0) {
                     raise_last();
                 }
                 return n;
             },
             py::arg("seq"), py::arg("p0") = 0, py::arg("p1") = -1)
        .def("kv_seq_copy",
             [](Context & s, int32_t src, int32_t dst, int32_t p0, int32_t p1) {
                 const int32_t n = specee_kv_seq_copy(s.ptr, src, dst, p0, p1);
                 if (n < 0) {
                     raise_last();
                 }
                 return n;
             },
             py::arg("src"), py::arg("dst"), py::arg("p0") = 0, py::arg("p1") = -1)
        .def("kv_seq_pos_max", [](const Context & s, int32_t seq) { return specee_kv_seq_pos_max(s.ptr, seq); })
        .def("kv_seq_n_cells", [](const Context & s, int32_t seq) { return specee_kv_seq_n_cells(s.ptr, seq); })
        .def("kv_cell_has_seq",
             [](const Context & s, int32_t c, int32_t seq) { return specee_kv_cell_has_seq(s.ptr, c, seq); })
        .def("embed", &Context::embed, py::arg("tokens"), py::arg("n_tokens"), py::arg("pooling") = -1,
             py::arg("normalize") = true);

    py::class_<Grammar>(m, "Grammar")
        .def(py::init<py::object, int32_t, const std::string &>(), py::arg("model"), py::arg("type"), py::arg("text"))
        .def("mask", &Grammar::mask)
        .def("accept", &Grammar::accept, py::arg("token"))
        .def("rollback", &Grammar::rollback, py::arg("n_tokens"))
        .def("forced", &Grammar::forced, py::arg("n_max"))
        .def("valid_prefix", &Grammar::valid_prefix, py::arg("tokens"));
    py::class_<Slots>(m, "Slots")
        .def(py::init<py::object, int32_t, int32_t>(), py::arg("context"), py::arg("n_slots"), py::arg("n_chunk") = 0)
        .def_property_readonly("n_slots", [](const Slots & s) { return specee_slots_n_slots(s.ptr); })
        .def_property_readonly("n_ctx_slot", [](const Slots & s) { return specee_slots_n_ctx_slot(s.ptr); })
        .def_property_readonly("n_busy", [](const Slots & s) { return specee_slots_n_busy(s.ptr); })
        .def("submit", &Slots::submit, py::arg("tokens"), py::arg("options"), py::arg("n_predict") = -1,
             py::arg("n_probs") = -1, py::arg("slot") = -1)
        .def("n_past", [](const Slots & s, int32_t slot) { return specee_slots_n_past(s.ptr, slot); }, py::arg("slot"))
        .def("set_unified", &Slots::set_unified, py::arg("unified"))
        .def("cache", &Slots::cache, py::arg("action"), py::arg("slot"), py::arg("path") = "")
        .def("save_mem", &Slots::save_mem, py::arg("slot"))
        .def("restore_mem", &Slots::restore_mem, py::arg("slot"), py::arg("bytes"))
        .def("cache_tokens", &Slots::cache_tokens, py::arg("slot"))
        .def("choose", &Slots::choose, py::arg("tokens"))
        .def("step", &Slots::step)
        .def("read", &Slots::read, py::arg("slot"))
        .def("set_post_sampling_probs",
             [](Slots & s, int32_t slot, bool on) {
                 if (specee_slots_set_post_sampling_probs(s.ptr, slot, on) < 0) {
                     raise_last();
                 }
             }, py::arg("slot"), py::arg("on"))
        .def("release", &Slots::release, py::arg("slot"))
        .def("stats", [](const Slots & s, int32_t slot) { return stats_dict(specee_slots_stats(s.ptr, slot)); })
        .def("mode",
             [](const Slots & s, int32_t slot) { return std::string(specee_mode_name(specee_slots_mode(s.ptr, slot))); })
        .def("totals", &Slots::totals)
        .def("embed", &Slots::embed, py::arg("tokens"), py::arg("pooling") = -1)
        .def("set_context_shift",
             [](Slots & s, bool enable, int32_t n_keep) { specee_slots_set_context_shift(s.ptr, enable, n_keep); },
             py::arg("enable"), py::arg("n_keep") = 0)
        .def("n_shifted", [](const Slots & s, int32_t slot) { return specee_slots_n_shifted(s.ptr, slot); });

    const specee_sampler_params sd = specee_sampler_default_params();
    py::class_<Sampler>(m, "Sampler")
        .def(py::init<float, int32_t, float, float, float, int32_t, std::optional<int64_t>>(),
             py::arg("temp") = sd.temp, py::arg("top_k") = sd.top_k, py::arg("top_p") = sd.top_p,
             py::arg("min_p") = sd.min_p, py::arg("repeat_penalty") = sd.repeat_penalty,
             py::arg("repeat_last_n") = sd.repeat_last_n, py::arg("seed") = py::none())
        .def("sample", &Sampler::sample, py::arg("logits"))
        .def("probs", &Sampler::probs, py::arg("logits"))
        .def("accept", [](Sampler & s, int32_t token) { specee_sampler_accept(s.ptr, token); }, py::arg("token"))
        .def(
            "set_logit_bias",
            [](Sampler & s, int32_t token, float bias) {
                if (specee_sampler_set_logit_bias(s.ptr, token, bias) != 0) {
                    raise_last();
                }
            },
            py::arg("token"), py::arg("bias"))
        .def("reset", [](Sampler & s) { specee_sampler_reset(s.ptr); });

    py::class_<Generator>(m, "Generator")
        .def(py::init<py::object, const py::object &>(), py::arg("context"), py::arg("options"))
        .def("set_params", &Generator::set_params, py::arg("options"))
        .def("start", &Generator::start, py::arg("tokens"))
        .def("next", &Generator::next, py::arg("n_max"))
        .def("stats", &Generator::stats)
        .def("reset_stats", [](Generator & g) { specee_generator_reset_stats(g.ptr); })
        .def_property_readonly("mode", [](const Generator & g) { return std::string(specee_mode_name(specee_generator_mode(g.ptr))); })
        .def_property_readonly("why", [](const Generator & g) { return std::string(specee_generator_why(g.ptr)); })
        .def_property_readonly("seed", [](const Generator & g) { return specee_generator_seed(g.ptr); });

    m.def("rpc_add_servers",
          [](const std::string & servers) {
              if (specee_rpc_add_servers(servers.c_str()) != 0) {
                  raise_last();
              }
          },
          py::arg("servers"));
    m.def("devices", [] {
        py::list out;
        for (int32_t i = 0; i < specee_device_count(); ++i) {
            const char * name = nullptr, * desc = nullptr;
            size_t       free = 0, total = 0;
            specee_device_info(i, &name, &desc, &free, &total);
            out.append(py::make_tuple(std::string(name), std::string(desc), free, total));
        }
        return out;
    });

    m.def("draft_head_eval",
          [](py::object ctx_obj, const i32_array & tokens, const f32_array & features, const i32_array & draft_tokens) {
              Context &     ctx     = ctx_obj.cast<Context &>();
              const int32_t n       = (int32_t) tokens.size();
              const int32_t n_draft = (int32_t) draft_tokens.size();
              const int32_t n_embd  = specee_model_n_embd(ctx.model);
              const int32_t n_feat  = specee_model_eagle_n_feature(ctx.model);
              if (features.ndim() != 2 || features.shape(0) != n || (n_feat > 0 && features.shape(1) != n_feat)) {
                  throw py::value_error("features must be [n_tokens, " + std::to_string(n_feat) +
                                        "] (the target feature width of the model's draft head)");
              }
              py::array_t<float> logits({n + n_draft, specee_model_eagle_n_vocab(ctx.model)});
              py::array_t<float> out({n + n_draft, n_embd});
              int32_t            rc;
              {
                  py::gil_scoped_release release;
                  rc = specee_draft_head_eval_steps(ctx.ptr, tokens.data(), features.data(), n, draft_tokens.data(),
                                                    n_draft, logits.mutable_data(), out.mutable_data());
              }
              if (rc != 0) {
                  raise_last();
              }
              return py::make_tuple(logits, out);
          },
          py::arg("context"), py::arg("tokens"), py::arg("features"), py::arg("draft_tokens") = i32_array(std::vector<py::ssize_t>{0}));
    m.def("draft_head_eval_chains",
          [](py::object ctx_obj, const i32_array & tokens, const f32_array & features, const i32_array & roots,
             int32_t depth) {
              Context &     ctx     = ctx_obj.cast<Context &>();
              const int32_t n       = (int32_t) tokens.size();
              const int32_t n_roots = (int32_t) roots.size();
              const int32_t n_feat  = specee_model_eagle_n_feature(ctx.model);
              if (features.ndim() != 2 || features.shape(0) != n || (n_feat > 0 && features.shape(1) != n_feat)) {
                  throw py::value_error("features must be [n_tokens, " + std::to_string(n_feat) +
                                        "] (the target feature width of the model's draft head)");
              }
              if (depth < 0) {
                  throw py::value_error("depth must be >= 0");
              }
              py::array_t<float> logits({n_roots, depth + 1, specee_model_eagle_n_vocab(ctx.model)});
              int32_t            rc;
              {
                  py::gil_scoped_release release;
                  rc = specee_draft_head_eval_chains(ctx.ptr, tokens.data(), features.data(), n, roots.data(), n_roots,
                                                     depth, logits.mutable_data());
              }
              if (rc != 0) {
                  raise_last();
              }
              return logits;
          },
          py::arg("context"), py::arg("tokens"), py::arg("features"), py::arg("roots"), py::arg("depth"));
    m.attr("GRAMMAR_GBNF")        = (int) SPECEE_GRAMMAR_GBNF;
    m.attr("GRAMMAR_JSON_SCHEMA") = (int) SPECEE_GRAMMAR_JSON_SCHEMA;
    m.attr("GRAMMAR_LARK")        = (int) SPECEE_GRAMMAR_LARK;
    m.attr("GRAMMAR_REGEX")       = (int) SPECEE_GRAMMAR_REGEX;
    m.def("grammar_set_library", [](const std::string & path) { specee_grammar_set_library(path.c_str()); },
          py::arg("path"));
    m.def("grammar_type_of",
          [](int32_t asked, bool schema) {
              const int32_t t = specee_grammar_type_of(asked, schema);
              if (t < 0) {
                  throw py::value_error(specee_last_error());
              }
              return t;
          },
          py::arg("asked"), py::arg("schema"),
          "the type a structured-output text is compiled as: a schema's json_schema, a grammar's the one asked (gbnf "
          "for none): the library's rule");
    m.def("grammar_limits", [] {
              py::dict d;
              for (int32_t i = 0; i < specee_grammar_limit_count(); ++i) {
                  d[specee_grammar_limit_name(i)] = py::make_tuple(specee_grammar_limit(specee_grammar_limit_name(i)),
                                                                   specee_grammar_limit_help(i));
              }
              return d;
          });
    m.def("grammar_set_limit",
          [](const std::string & name, int64_t value) {
              if (specee_grammar_set_limit(name.c_str(), value) != 0) {
                  raise_last();
              }
          },
          py::arg("name"), py::arg("value"));
    m.def("grammar_cache_info", [] {
        return py::dict(py::arg("entries") = specee_grammar_cache_size(), py::arg("hits") = specee_grammar_cache_hits());
    });
    m.def("grammar_cache_clear", [] { specee_grammar_cache_clear(); });
    m.def("grammar_n_abandoned", [] { return specee_grammar_n_abandoned(); });
    m.def("grammar_check",
          [](const Model & model, int32_t type, const std::string & text) {
              int32_t r;
              {
                  py::gil_scoped_release release;
                  r = specee_grammar_check(model.ptr, type, text.c_str());
              }
              if (r != 0) {
                  raise_last();
              }
          },
          py::arg("model"), py::arg("type"), py::arg("text"));
    m.def("eagle_check_choices",
          [](const std::string & choices) {
              const int32_t n = specee_eagle_check_choices(choices.c_str());
              if (n < 0) {
                  raise_last();
              }
              return n;
          },
          py::arg("choices"));
    m.def("arch_keys", [] {
        py::dict keys;
        for (int32_t i = 0; specee_arch_key(i); ++i) {
            const std::string kv = specee_arch_key(i);
            const size_t      eq = kv.find('=');
            keys[py::str(kv.substr(0, eq))] = kv.substr(eq + 1);
        }
        return keys;
    });

    m.def("chat_template_detect",
          [](const std::string & text) -> std::optional<std::string> {
              const char * name = specee_chat_template_detect(text.c_str());
              return name ? std::optional<std::string>(name) : std::nullopt;
          },
          py::arg("text"));
    m.def("chat_template_resolve",
          [](const Model & model, std::optional<std::string> name) {
              const char * t = specee_chat_template_resolve(model.ptr, name ? name->c_str() : nullptr);
              if (!t) {
                  raise_last();
              }
              return std::string(t);
          },
          py::arg("model"), py::arg("name") = py::none());
    m.def("chat_tokenize",
          [](const Model & model, std::optional<std::string> name,
             const std::vector<std::map<std::string, std::string>> & messages, bool add_ass) {
              const std::vector<specee_chat_message> msgs = chat_messages(messages);
              const char * tmpl = name ? name->c_str() : nullptr;
              int32_t n = specee_chat_tokenize(model.ptr, tmpl, msgs.data(), (int32_t) msgs.size(), add_ass, nullptr, 0);
              if (n == INT32_MIN) {
                  raise_last();
              }
              std::vector<int32_t> ids(std::abs(n));
              specee_chat_tokenize(model.ptr, tmpl, msgs.data(), (int32_t) msgs.size(), add_ass, ids.data(),
                                   (int32_t) ids.size());
              return ids;
          },
          py::arg("model"), py::arg("name"), py::arg("messages"), py::arg("add_ass") = true);
    m.def("chat_apply_template",
          [](const std::string & name, const std::vector<std::map<std::string, std::string>> & messages,
             bool add_ass) {
              const std::vector<specee_chat_message> msgs = chat_messages(messages);
              const int32_t n = specee_chat_apply_template(name.c_str(), msgs.data(), (int32_t) msgs.size(), add_ass,
                                                           nullptr, 0);
              if (n == INT32_MIN) {
                  raise_last();
              }
              std::string out(n < 0 ? -n : n, '\0');
              if (specee_chat_apply_template(name.c_str(), msgs.data(), (int32_t) msgs.size(), add_ass, &out[0],
                                             (int32_t) out.size()) == INT32_MIN) {
                  raise_last();
              }
              return out;
          },
          py::arg("name"), py::arg("messages"), py::arg("add_ass") = true);
}
