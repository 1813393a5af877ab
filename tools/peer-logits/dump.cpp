// llama.cpp's side of tools/peer-logits (run.sh builds it against libllama).
// usage: dump MODEL.gguf PROMPT N_STEPS LOGITS_OUT.f32 [--prompt-file] [--fa on|off|auto] [--ub N] [--no-repack]
//   PROMPT is the text itself, or a file path with --prompt-file (read byte-exact).
// Tokenizes with the model's default BOS rule (add_special=true), no special-token parsing,
// evaluates the prompt in one batch (logits of the last token), then N greedy steps (argmax,
// no sampler). Prints JSON: prompt ids, generated ids, top-10 (id, logit) of the first step;
// writes the full first-step logits as raw float32 to LOGITS_OUT.f32.
#include "llama.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

static void quiet_log(enum ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN) fputs(text, stderr);
}

int main(int argc, char ** argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL PROMPT N_STEPS LOGITS_OUT [--prompt-file] [--fa on|off|auto] [--ub N]\n", argv[0]);
        return 2;
    }
    const char * model_path = argv[1];
    std::string prompt = argv[2];
    const int n_steps = atoi(argv[3]);
    const char * logits_out = argv[4];
    bool prompt_is_file = false;
    int fa = -1;  // auto
    int ubatch = 0;
    bool no_repack = false;
    for (int i = 5; i < argc; i++) {
        if (!strcmp(argv[i], "--prompt-file")) prompt_is_file = true;
        else if (!strcmp(argv[i], "--no-repack")) no_repack = true;
        else if (!strcmp(argv[i], "--fa") && i + 1 < argc) {
            std::string v = argv[++i];
            fa = v == "on" ? 1 : v == "off" ? 0 : -1;
        } else if (!strcmp(argv[i], "--ub") && i + 1 < argc) ubatch = atoi(argv[++i]);
    }
    if (prompt_is_file) {
        std::ifstream f(prompt, std::ios::binary);
        if (!f) { fprintf(stderr, "cannot read %s\n", prompt.c_str()); return 1; }
        std::stringstream ss; ss << f.rdbuf(); prompt = ss.str();
    }
    if (!getenv("DUMP_VERBOSE")) llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    if (no_repack) mp.use_extra_bufts = false;  // no CPU weight repacking (Q4_0x8, Q4_Kx8, ...)
    mp.progress_callback = [](float, void *) { return true; };  // no progress dots
    llama_model * model = llama_model_load_from_file(model_path, mp);
    if (!model) { fprintf(stderr, "failed to load model %s\n", model_path); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    // tokenize: default BOS rule, no special parsing
    int n = -llama_tokenize(vocab, prompt.data(), (int32_t) prompt.size(), nullptr, 0, true, false);
    std::vector<llama_token> toks(n);
    if (llama_tokenize(vocab, prompt.data(), (int32_t) prompt.size(), toks.data(), n, true, false) != n) {
        fprintf(stderr, "tokenize failed\n"); return 1;
    }

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = std::max<uint32_t>(256, (uint32_t) (n + n_steps + 16));
    cp.n_batch = std::max<uint32_t>(cp.n_ctx, 512);
    cp.n_ubatch = ubatch > 0 ? ubatch : cp.n_batch;  // one ubatch for the whole prompt
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    cp.flash_attn_type = fa == 1 ? LLAMA_FLASH_ATTN_TYPE_ENABLED : fa == 0 ? LLAMA_FLASH_ATTN_TYPE_DISABLED
                                                                            : LLAMA_FLASH_ATTN_TYPE_AUTO;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "failed to create context\n"); return 1; }

    std::vector<llama_token> prompt_ids = toks;
    if (llama_decode(ctx, llama_batch_get_one(toks.data(), (int32_t) toks.size())) != 0) {
        fprintf(stderr, "decode (prompt) failed\n"); return 1;
    }
    const float * lg = llama_get_logits_ith(ctx, -1);
    std::vector<float> first(lg, lg + n_vocab);
    {
        FILE * f = fopen(logits_out, "wb");
        fwrite(first.data(), sizeof(float), first.size(), f);
        fclose(f);
    }
    std::vector<int> order(n_vocab);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return first[a] > first[b]; });

    std::vector<llama_token> gen;
    const float * cur = first.data();
    std::vector<float> buf;
    for (int s = 0; s < n_steps; s++) {
        llama_token t = (llama_token) (std::max_element(cur, cur + n_vocab) - cur);  // first max, as np.argmax
        gen.push_back(t);
        if (s == n_steps - 1) break;
        if (llama_decode(ctx, llama_batch_get_one(&t, 1)) != 0) { fprintf(stderr, "decode failed at step %d\n", s); return 1; }
        const float * l = llama_get_logits_ith(ctx, -1);
        buf.assign(l, l + n_vocab);
        cur = buf.data();
    }

    printf("{\"prompt_ids\": [");
    for (size_t i = 0; i < prompt_ids.size(); i++) printf("%s%d", i ? ", " : "", prompt_ids[i]);
    printf("], \"generated\": [");
    for (size_t i = 0; i < gen.size(); i++) printf("%s%d", i ? ", " : "", gen[i]);
    printf("], \"top10\": [");
    for (int i = 0; i < 10 && i < n_vocab; i++) printf("%s[%d, %.9g]", i ? ", " : "", order[i], first[order[i]]);
    printf("], \"n_vocab\": %d, \"add_bos\": %s}\n", n_vocab, llama_vocab_get_add_bos(vocab) ? "true" : "false");

    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
