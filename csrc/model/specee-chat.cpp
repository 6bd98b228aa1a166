// specee-chat.cpp: chat templates, rendered by hand to the same bytes as their Jinja originals
//
// A GGUF carries its template as Jinja text (tokenizer.chat_template). Rather than interpret Jinja,
// the few templates of the Llama family are recognised by marker strings and rendered here;
// tests/test_chat.py renders the original Jinja with jinja2 and compares byte for byte.
//
//   chatml   <|im_start|>role\ncontent<|im_end|>\n ... <|im_start|>assistant\n
//   smollm2  chatml, with SmolLM2's default system message when the first message is not a system one
//   qwen2.5  chatml, with Qwen2.5's default system message likewise (Qwen2 and Qwen3: plain chatml)
//   llama2   Llama-2-chat: <s>[INST] <<SYS>>\nsys\n<</SYS>>\n\nuser [/INST] answer </s><s>[INST] ...
//   vicuna   Vicuna v1.1 (FastChat): "sys USER: u ASSISTANT: a</s>USER: u ASSISTANT:"
//   llama3   Llama-3-instruct: <|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
//   zephyr   <|role|>\ncontent</s>\n ... <|assistant|>\n
//   phi3     <|role|>\ncontent<|end|>\n ... <|assistant|>\n (Phi-3 / Phi-3.5 instruct; no generation prompt: the EOS)
//   gemma    <bos><start_of_turn>user\ncontent<end_of_turn>\n<start_of_turn>model\n (Gemma 2 and 3 instruct)
//   command-r <|START_OF_TURN_TOKEN|><|USER_TOKEN|>content<|END_OF_TURN_TOKEN|> ... <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>
//            (Cohere Command-R, by name only: a model's own Cohere template, tool use and thinking included, is Jinja)
#include "specee-impl.h"
#include "specee-model.h"
#include "specee-vocab.h"
#include "specee.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <string>
#include <vector>

static const char * const SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";
static const char * const QWEN25_SYSTEM  = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";
static const char * const VICUNA_SYSTEM =
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions.";
static const char * const ALTERNATE_ERROR = "Conversation roles must alternate user/assistant/user/assistant/...";

static const char * const TEMPLATE_NAMES[] = {"chatml", "smollm2", "qwen2.5", "llama2",
                                              "vicuna", "llama3",  "zephyr",  "phi3", "gemma", "command-r"};

// the names above, comma separated, for messages
static std::string template_names() {
    std::string out;
    for (const char * name : TEMPLATE_NAMES) {
        out += (out.empty() ? "" : ", ") + std::string(name);
    }
    return out;
}

struct chat_message {
    std::string role;
    std::string content;
};

// ---- Python's str.strip(), which the Jinja templates call ------------------------------------

// the code point of the UTF-8 sequence that starts at s[i] (-1 when invalid) and its length in n
static long utf8_decode(const std::string & s, size_t i, size_t & n) {
    const unsigned char c = (unsigned char) s[i];
    long                cp;
    if (c < 0x80) {
        n = 1;
        return c;
    } else if ((c & 0xE0) == 0xC0) {
        n  = 2;
        cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
        n  = 3;
        cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
        n  = 4;
        cp = c & 0x07;
    } else {
        n = 1;
        return -1;
    }
    if (i + n > s.size()) {
        n = 1;
        return -1;
    }
    for (size_t k = 1; k < n; ++k) {
        const unsigned char cc = (unsigned char) s[i + k];
        if ((cc & 0xC0) != 0x80) {
            n = 1;
            return -1;
        }
        cp = (cp << 6) | (cc & 0x3F);
    }
    return cp;
}

// str.isspace(): bidirectional class WS, B or S, or category Zs
static bool py_isspace(long cp) {
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

static std::string py_strip(const std::string & s) {
    // first non-space from the front
    size_t begin = 0;
    while (begin < s.size()) {
        size_t n;
        if (!py_isspace(utf8_decode(s, begin, n))) {
            break;
        }
        begin += n;
    }
    // scan forward, remembering where the last non-space code point ends
    size_t end = begin;
    for (size_t i = begin; i < s.size();) {
        size_t n;
        const bool space = py_isspace(utf8_decode(s, i, n));
        i += n;
        if (!space) {
            end = i;
        }
    }
    return s.substr(begin, end - begin);
}

// ---- the templates -------------------------------------------------------------------------------

static std::string render_chatml(const std::vector<chat_message> & msgs, bool add_ass, const char * default_system) {
    std::string out;
    for (size_t i = 0; i < msgs.size(); ++i) {
        if (i == 0 && default_system && msgs[0].role != "system") {
            out += std::string("<|im_start|>system\n") + default_system + "<|im_end|>\n";
        }
        out += "<|im_start|>" + msgs[i].role + "\n" + msgs[i].content + "<|im_end|>\n";
    }
    if (add_ass) {
        out += "<|im_start|>assistant\n";
    }
    return out;
}

// meta-llama/Llama-2-*-chat-hf: the system message goes inside the first user turn; every user turn
// opens with the BOS text; no generation prompt (a user turn already ends with [/INST])
static std::string render_llama2(const std::vector<chat_message> & msgs) {
    size_t      first      = 0;
    bool        has_system = false;
    std::string system;
    if (!msgs.empty() && msgs[0].role == "system") {
        has_system = true;
        system     = msgs[0].content;
        first      = 1;
    }
    std::string out;
    for (size_t i = first; i < msgs.size(); ++i) {
        const size_t       idx  = i - first;
        const chat_message & m  = msgs[i];
        if ((m.role == "user") != (idx % 2 == 0)) {
            specee_fail("%s", ALTERNATE_ERROR);
        }
        std::string content = m.content;
        if (idx == 0 && has_system) {
            content = "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + m.content;
        }
        if (m.role == "user") {
            out += "<s>[INST] " + py_strip(content) + " [/INST]";
        } else if (m.role == "assistant") {
            out += " " + py_strip(content) + " </s>";
        }
    }
    return out;
}

// FastChat's vicuna_v1.1: system, then "USER: u" and "ASSISTANT: a" joined by " " after a user turn and
// "</s>" after an assistant turn
static std::string render_vicuna(const std::vector<chat_message> & msgs, bool add_ass) {
    size_t      first  = 0;
    std::string system = VICUNA_SYSTEM;
    if (!msgs.empty() && msgs[0].role == "system") {
        system = msgs[0].content;
        first  = 1;
    }
    std::string out = system + " ";
    for (size_t i = first; i < msgs.size(); ++i) {
        if (msgs[i].role == "user") {
            out += "USER: " + msgs[i].content + " ";
        } else if (msgs[i].role == "assistant") {
            out += "ASSISTANT: " + msgs[i].content + "</s>";
        }
    }
    if (add_ass) {
        out += "ASSISTANT:";
    }
    return out;
}

// meta-llama/Meta-Llama-3-*-Instruct
static std::string render_llama3(const std::vector<chat_message> & msgs, bool add_ass) {
    std::string out;
    for (size_t i = 0; i < msgs.size(); ++i) {
        if (i == 0) {
            out += "<|begin_of_text|>";
        }
        out += "<|start_header_id|>" + msgs[i].role + "<|end_header_id|>\n\n" + py_strip(msgs[i].content) +
               "<|eot_id|>";
    }
    if (add_ass) {
        out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
    }
    return out;
}

// HuggingFaceH4/zephyr-7b-beta (also TinyLlama-chat); the generation prompt follows the last message only
static std::string render_zephyr(const std::vector<chat_message> & msgs, bool add_ass) {
    std::string out;
    for (const auto & m : msgs) {
        if (m.role == "user" || m.role == "system" || m.role == "assistant") {
            out += "<|" + m.role + "|>\n" + m.content + "</s>\n";
        }
    }
    if (add_ass && !msgs.empty()) {
        out += "<|assistant|>\n";
    }
    return out;
}

// microsoft/Phi-3(.5)-mini-instruct: every message (system, user, assistant; others dropped) as <|role|>\ncontent<|end|>\n,
// then the generation prompt, or without one the EOS token
static std::string render_phi3(const std::vector<chat_message> & msgs, bool add_ass) {
    std::string out;
    for (const chat_message & m : msgs) {
        if (m.role == "system" || m.role == "user" || m.role == "assistant") {
            out += "<|" + m.role + "|>\n" + m.content + "<|end|>\n";
        }
    }
    return out + (add_ass ? "<|assistant|>\n" : "<|endoftext|>");
}

// google/gemma-3-*-it (Gemma 2's renders the same without a system message, which it refuses): the BOS text, a system
// message prepended to the first turn with a blank line, turns alternating user / model (the assistant's role), each
// content stripped
static std::string render_gemma(const std::vector<chat_message> & msgs, bool add_ass) {
    size_t      first = 0;
    std::string prefix;
    if (!msgs.empty() && msgs[0].role == "system") {
        prefix = msgs[0].content + "\n\n";
        first  = 1;
    }
    std::string out = "<bos>";
    for (size_t i = first; i < msgs.size(); ++i) {
        const chat_message & m = msgs[i];
        if ((m.role == "user") != ((i - first) % 2 == 0)) {
            specee_fail("%s", ALTERNATE_ERROR);
        }
        const std::string role = m.role == "assistant" ? "model" : m.role;
        out += "<start_of_turn>" + role + "\n" + (i == first ? prefix : "") + py_strip(m.content) + "<end_of_turn>\n";
    }
    return out + (add_ass ? "<start_of_turn>model\n" : "");
}

// CohereForAI/c4ai-command-r-v01 and -plus, as llama.cpp's "command-r" renders them: a turn per message (system, user,
// assistant as the chatbot; others dropped), each content stripped, no BOS text (the tokenizer adds it)
static std::string render_command_r(const std::vector<chat_message> & msgs, bool add_ass) {
    std::string out;
    for (const chat_message & m : msgs) {
        const char * token = m.role == "system"    ? "<|SYSTEM_TOKEN|>" :
                             m.role == "user"      ? "<|USER_TOKEN|>" :
                             m.role == "assistant" ? "<|CHATBOT_TOKEN|>" :
                                                     nullptr;
        if (token) {
            out += std::string("<|START_OF_TURN_TOKEN|>") + token + py_strip(m.content) + "<|END_OF_TURN_TOKEN|>";
        }
    }
    return out + (add_ass ? "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>" : "");
}

// ---- API -----------------------------------------------------------------------------------------

extern "C" const char * specee_chat_template_detect(const char * tmpl) {
    if (!tmpl) {
        return nullptr;
    }
    for (const char * name : TEMPLATE_NAMES) {
        if (strcmp(tmpl, name) == 0) {
            return name;
        }
    }
    const std::string t(tmpl);
    auto has = [&](const char * s) { return t.find(s) != std::string::npos; };
    if (has("<|im_start|>")) {
        return has(SMOLLM2_SYSTEM) ? "smollm2" : has(QWEN25_SYSTEM) ? "qwen2.5" : "chatml";
    }
    if (has("[INST]")) {
        return "llama2";
    }
    if (has("<|start_header_id|>") && has("<|end_header_id|>")) {
        return "llama3";
    }
    if (has("<|assistant|>") && has("<|end|>")) {
        return "phi3";
    }
    if (has("<start_of_turn>")) {
        return "gemma";
    }
    if (has("<|user|>") && has("<|assistant|>")) {
        return "zephyr";
    }
    if (has("USER:") && has("ASSISTANT:")) {
        return "vicuna";
    }
    return nullptr;
}

static int32_t chat_apply_impl(const char * name, const specee_chat_message * msgs, int32_t n_msgs, bool add_ass,
                               char * buf, int32_t len) {
    if (!name) {
        specee_fail("no chat template name");
    }
    if (n_msgs < 0 || (n_msgs > 0 && !msgs)) {
        specee_fail("invalid message list (%d messages)", n_msgs);
    }
    std::vector<chat_message> chat;
    for (int32_t i = 0; i < n_msgs; ++i) {
        if (!msgs[i].role || !msgs[i].content) {
            specee_fail("message %d has no role or no content", i);
        }
        chat.push_back({msgs[i].role, msgs[i].content});
    }
    const std::string n = name;
    std::string       out;
    if (n == "chatml") {
        out = render_chatml(chat, add_ass, nullptr);
    } else if (n == "smollm2") {
        out = render_chatml(chat, add_ass, SMOLLM2_SYSTEM);
    } else if (n == "qwen2.5") {
        out = render_chatml(chat, add_ass, QWEN25_SYSTEM);
    } else if (n == "llama2") {
        out = render_llama2(chat);
    } else if (n == "vicuna") {
        out = render_vicuna(chat, add_ass);
    } else if (n == "llama3") {
        out = render_llama3(chat, add_ass);
    } else if (n == "zephyr") {
        out = render_zephyr(chat, add_ass);
    } else if (n == "phi3") {
        out = render_phi3(chat, add_ass);
    } else if (n == "gemma") {
        out = render_gemma(chat, add_ass);
    } else if (n == "command-r") {
        out = render_command_r(chat, add_ass);
    } else {
        specee_fail("unknown chat template '%s' (known: %s)", name, template_names().c_str());
    }
    if (out.size() > (size_t) INT32_MAX - 1) {
        specee_fail("rendered chat is too long");
    }
    const int32_t n_out = (int32_t) out.size();
    if (!buf || len < n_out) {
        return -n_out;
    }
    memcpy(buf, out.data(), out.size());
    if (len > n_out) {
        buf[n_out] = '\0';
    }
    return n_out;
}

extern "C" int32_t specee_chat_apply_template(const char * name, const struct specee_chat_message * msgs,
                                              int32_t n_msgs, bool add_ass, char * buf, int32_t len) {
    return specee_guard<int32_t>(INT32_MIN, [&] { return chat_apply_impl(name, msgs, n_msgs, add_ass, buf, len); });
}

static const char * template_resolve_impl(const specee_model * model, const char * name) {
    if (name && *name) {
        const char * found = specee_chat_template_detect(name);
        if (!found) {
            specee_fail("unknown chat template '%s' (known: %s, or a Jinja text with the markers of one of them)", name,
                        template_names().c_str());
        }
        return found;
    }
    if (!model) {
        specee_fail("no model and no chat template name");
    }
    for (const auto & kv : model->meta) {
        if (kv.first == "tokenizer.chat_template") {
            const char * found = specee_chat_template_detect(kv.second.c_str());
            if (!found) {
                specee_fail("the model's chat template is not one this runtime knows; name one (%s)",
                            template_names().c_str());
            }
            return found;
        }
    }
    specee_fail("the model has no chat template; name one (%s)", template_names().c_str());
}

extern "C" const char * specee_chat_template_resolve(const specee_model * model, const char * name) {
    return specee_guard<const char *>(nullptr, [&] { return template_resolve_impl(model, name); });
}

extern "C" int32_t specee_chat_tokenize(const specee_model * model, const char * name, const struct specee_chat_message * msgs,
                                        int32_t n_msgs, bool add_ass, int32_t * tokens, int32_t n_max) {
    return specee_guard<int32_t>(INT32_MIN, [&] {
        const char *  tmpl = template_resolve_impl(model, name);
        const int32_t n    = chat_apply_impl(tmpl, msgs, n_msgs, add_ass, nullptr, 0);
        std::string   text(-n, '\0');
        chat_apply_impl(tmpl, msgs, n_msgs, add_ass, &text[0], (int32_t) text.size());
        const std::vector<int32_t> ids = specee_vocab_tokenize(*model, text, true, true);
        if (n_max < 0 || (n_max > 0 && !tokens)) {
            specee_fail("specee_chat_tokenize: no room for the tokens");
        }
        if ((int64_t) ids.size() > n_max) {
            return -(int32_t) ids.size();
        }
        std::copy(ids.begin(), ids.end(), tokens);
        return (int32_t) ids.size();
    });
}
