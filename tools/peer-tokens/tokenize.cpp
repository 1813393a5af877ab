// llama.cpp's tokenizer over a vocabulary-only load: one line of space-separated ids per input, as
// llama.cpp's test-tokenizer-0 writes them (no BOS, special tokens not parsed).
// usage: tokenize VOCAB.gguf INPUTS.txt   (inputs separated by a line "__ggml_vocab_test__")
#include "llama.h"

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static void quiet_log(ggml_log_level, const char *, void *) {}

int main(int argc, char ** argv) {
    if (argc != 3) { fprintf(stderr, "usage: %s VOCAB.gguf INPUTS.txt\n", argv[0]); return 2; }
    std::ifstream f(argv[2], std::ios::binary);
    if (!f) { fprintf(stderr, "cannot read %s\n", argv[2]); return 1; }
    std::stringstream ss; ss << f.rdbuf();
    const std::string all = ss.str(), sep = "\n__ggml_vocab_test__\n";
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "failed to load %s\n", argv[1]); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    size_t start = 0;
    while (start <= all.size()) {
        size_t end = all.find(sep, start);
        const std::string text = all.substr(start, end == std::string::npos ? std::string::npos : end - start);
        std::vector<llama_token> ids(text.size() + 8);
        int n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), false, false);
        if (n < 0) { ids.resize(-n); n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), false, false); }
        for (int i = 0; i < n; ++i) printf(i ? " %d" : "%d", ids[i]);
        printf("\n");
        if (end == std::string::npos) break;
        start = end + sep.size();
    }
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
