// specee-cli-args.h: llama-cli's command line: every flag once (name, value, help, what it sets), parsing, --help
#pragma once

#include "specee.h"

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

enum cnv_mode { CNV_AUTO, CNV_ON, CNV_OFF };

struct cli_params {
    std::string model, prompt, system_prompt, chat_template, draft_head;
    int         n_predict = -1, n_ctx = 0, n_batch = 2048, n_ubatch = 512;
    int         n_threads = std::min(specee_max_threads(), std::max(1, (int) std::thread::hardware_concurrency()));
    bool        escape = true, special = false, single_turn = false, verbose_prompt = false, display_prompt = true;
    cnv_mode    conversation = CNV_AUTO;
    std::string cache_type_v = "f32";
    specee_generator_params gen           = specee_generator_default_params(); // the generation flags set it

    // placement
    int                     n_gpu_layers  = -1;
    std::string             offload_order = "auto", devices, rpc_servers;
    std::vector<float>      tensor_split;
    bool                    list_devices  = false;
};

// false with a message on stderr when the command line is malformed; help: --help was given (the usage is printed)
bool cli_parse(int argc, char ** argv, cli_params & p, bool & help);
