// peer_timing: llama.cpp's side of the peer benchmark, against libllama only (no llama-common).
//
//   peer_timing bench    --model M.gguf --tokens T.i32 --contexts 2048,8192 [--suffix 24] [--repeats 10]
//                        [--decode 64] [--ngl 99] [--threads 2] [--ubatch 2048] [--kv f16] --out R.json
//   peer_timing fidelity --model M.gguf --prompt P.i32 --forced F.i32 --logits L.f32 [--ngl 0] [--kv f32] --out R.json
//
// bench, per context c (tokens T: c prefix tokens, then the suffix): cold TTFT of prefix+suffix (clear, decode, argmax
// of the last logits); the sequence state after the prefix through llama_state_seq_get_data / set_data, in host memory
// and with LLAMA_STATE_SEQ_FLAGS_ON_DEVICE (bytes of each); "restore + suffix + first token" for both; decode ms/token
// (greedy, one token per llama_decode). fidelity: logits after the prompt and after each forced token (teacher forcing,
// written as float32 rows), plus llama.cpp's own free-running greedy tokens from the same prompt.
#include "llama.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef PEER_LLAMA_COMMIT
#define PEER_LLAMA_COMMIT "unknown"
#endif

namespace {

using Tokens = std::vector<llama_token>;

double now_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

[[noreturn]] void fail(const std::string & why) {
    std::fprintf(stderr, "peer_timing: %s\n", why.c_str());
    std::exit(2);
}

std::map<std::string, std::string> parse_args(int argc, char ** argv) {
    std::map<std::string, std::string> args;
    for (int i = 2; i < argc; i += 2) {
        if (std::strncmp(argv[i], "--", 2) != 0 || i + 1 >= argc) fail(std::string("bad argument ") + argv[i]);
        args[argv[i] + 2] = argv[i + 1];
    }
    return args;
}

std::string arg(const std::map<std::string, std::string> & args, const std::string & key, const char * fallback) {
    auto it = args.find(key);
    if (it != args.end()) return it->second;
    if (!fallback) fail("missing --" + key);
    return fallback;
}

Tokens read_tokens(const std::string & path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("cannot read " + path);
    Tokens out;
    int32_t t;
    while (in.read(reinterpret_cast<char *>(&t), sizeof t)) out.push_back(t);
    return out;
}

std::vector<int> parse_ints(const std::string & csv) {
    std::vector<int> out;
    std::stringstream ss(csv);
    for (std::string item; std::getline(ss, item, ',');) out.push_back(std::stoi(item));
    return out;
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Peer {
    llama_model * model = nullptr;
    llama_context * ctx = nullptr;
    int n_vocab = 0;
    uint32_t n_batch = 0;
    ggml_type kv_type = GGML_TYPE_F16;

    Peer(const std::string & path, int ngl, int threads, uint32_t n_ctx, uint32_t ubatch, ggml_type kv) {
        llama_model_params mp = llama_model_default_params();
        mp.n_gpu_layers = ngl;
        model = llama_model_load_from_file(path.c_str(), mp);
        if (!model) fail("cannot load " + path);
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = n_ctx;
        cp.n_batch = n_ctx;
        cp.n_ubatch = std::min(ubatch, n_ctx);
        cp.n_seq_max = 1;
        cp.n_outputs_max = 1;          // only the last token's logits: no n_ubatch x n_vocab output reservation
        cp.n_threads = cp.n_threads_batch = threads;
        cp.no_perf = true;
        cp.type_k = cp.type_v = kv_type = kv;
        ctx = llama_init_from_model(model, cp);
        if (!ctx) fail("cannot create a context");
        n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
        n_batch = llama_n_batch(ctx);
    }
    ~Peer() {
        llama_free(ctx);
        llama_model_free(model);
    }

    void clear() { llama_memory_clear(llama_get_memory(ctx), true); }

    // Append tokens to sequence 0 (positions continue from the memory); logits for the last one only.
    void feed(const llama_token * tokens, size_t count) {
        for (size_t done = 0; done < count;) {
            const int32_t n = static_cast<int32_t>(std::min<size_t>(n_batch, count - done));
            llama_batch batch = llama_batch_get_one(const_cast<llama_token *>(tokens + done), n);
            const int rc = llama_decode(ctx, batch);
            if (rc != 0) fail("llama_decode returned " + std::to_string(rc));
            done += n;
        }
    }

    const float * logits() { return llama_get_logits_ith(ctx, -1); }   // synchronises

    llama_token argmax() {
        const float * l = logits();
        return static_cast<llama_token>(std::max_element(l, l + n_vocab) - l);
    }
};

struct State {
    std::vector<uint8_t> bytes;
    llama_state_seq_flags flags;

    State(Peer & p, llama_state_seq_flags f) : flags(f) { bytes.resize(llama_state_seq_get_size_ext(p.ctx, 0, f)); }

    void save(Peer & p) {
        if (llama_state_seq_get_data_ext(p.ctx, bytes.data(), bytes.size(), 0, flags) != bytes.size())
            fail("llama_state_seq_get_data_ext failed");
        llama_synchronize(p.ctx);
    }
    void restore(Peer & p) {
        if (llama_state_seq_set_data_ext(p.ctx, bytes.data(), bytes.size(), 0, flags) == 0)
            fail("llama_state_seq_set_data_ext failed");
        llama_synchronize(p.ctx);
    }
};

ggml_type kv_type(const std::string & name) {
    if (name == "f16") return GGML_TYPE_F16;
    if (name == "bf16") return GGML_TYPE_BF16;
    if (name == "f32") return GGML_TYPE_F32;
    fail("--kv must be f16, bf16 or f32");
}

template <class F> std::vector<double> times(int repeats, F && fn) {
    std::vector<double> out;
    for (int i = 0; i < repeats; ++i) {
        const double t0 = now_ms();
        fn();
        out.push_back(now_ms() - t0);
    }
    return out;
}

std::string bench_context(Peer & p, const Tokens & all, int context, int suffix_len, int repeats, int decode) {
    if (static_cast<int>(all.size()) < context + suffix_len) fail("token file shorter than context + suffix");
    Tokens cold_tokens(all.begin(), all.begin() + context);
    cold_tokens.insert(cold_tokens.end(), all.end() - suffix_len, all.end());
    const llama_token * suffix = cold_tokens.data() + context;
    llama_token cold_first = -1;
    auto cold = [&] { p.clear(); p.feed(cold_tokens.data(), cold_tokens.size()); cold_first = p.argmax(); };
    cold();                                                           // warm-up
    const double cold_ms = median(times(repeats, cold));

    p.clear();
    p.feed(cold_tokens.data(), context);
    State host(p, LLAMA_STATE_SEQ_FLAGS_NONE), device(p, LLAMA_STATE_SEQ_FLAGS_ON_DEVICE);
    host.save(p);
    device.save(p);
    const double host_get = median(times(repeats, [&] { host.save(p); }));
    const double host_set = median(times(repeats, [&] { host.restore(p); }));
    const double dev_get = median(times(repeats, [&] { device.save(p); }));
    const double dev_set = median(times(repeats, [&] { device.restore(p); }));

    llama_token first_host = -1, first_device = -1;
    auto resume = [&](State & s, llama_token & first) { s.restore(p); p.feed(suffix, suffix_len); first = p.argmax(); };
    const double host_ttft = median(times(repeats, [&] { resume(host, first_host); }));
    const double dev_ttft = median(times(repeats, [&] { resume(device, first_device); }));

    // Decode after restore + suffix, greedy, one token per llama_decode (2 warm-up steps are not timed).
    resume(device, first_device);
    llama_token token = first_device;
    std::vector<double> steps;
    for (int i = 0; i < decode + 2; ++i) {
        const double t0 = now_ms();
        p.feed(&token, 1);
        token = p.argmax();
        if (i >= 2) steps.push_back(now_ms() - t0);
    }
    double decode_ms = 0.0;
    for (double s : steps) decode_ms += s;
    decode_ms /= std::max<size_t>(1, steps.size());

    char row[1024];
    std::snprintf(row, sizeof row,
                  "{\"context\": %d, \"suffix\": %d, \"cold_ttft_ms\": %.4f, \"state_host_bytes\": %zu, "
                  "\"state_get_host_ms\": %.4f, \"state_set_host_ms\": %.4f, \"state_device_host_bytes\": %zu, "
                  "\"state_get_device_ms\": %.4f, \"state_set_device_ms\": %.4f, \"restore_suffix_ttft_host_ms\": %.4f, "
                  "\"restore_suffix_ttft_device_ms\": %.4f, \"decode_ms_per_token\": %.4f, \"decode_tokens\": %zu, "
                  "\"first_token_cold\": %d, \"first_token_host_restore\": %d, \"first_token_device_restore\": %d}",
                  context, suffix_len, cold_ms, host.bytes.size(), host_get, host_set, device.bytes.size(), dev_get,
                  dev_set, host_ttft, dev_ttft, decode_ms, steps.size(), cold_first, first_host, first_device);
    return row;
}

std::string header(Peer & p) {
    char out[512];
    std::snprintf(out, sizeof out, "\"llama_cpp_commit\": \"%s\", \"n_vocab\": %d, \"n_ctx\": %u, \"n_batch\": %u, "
                  "\"n_ubatch\": %u, \"kv_cache\": \"%s\", \"model_bytes\": %llu",
                  PEER_LLAMA_COMMIT, p.n_vocab, llama_n_ctx(p.ctx), p.n_batch, llama_n_ubatch(p.ctx),
                  ggml_type_name(p.kv_type), static_cast<unsigned long long>(llama_model_size(p.model)));
    return out;
}

void write_json(const std::string & path, const std::string & body) {
    std::ofstream out(path);
    out << body << "\n";
    if (!out) fail("cannot write " + path);
}

int run_bench(const std::map<std::string, std::string> & a) {
    const Tokens all = read_tokens(arg(a, "tokens", nullptr));
    const std::vector<int> contexts = parse_ints(arg(a, "contexts", nullptr));
    const int suffix = std::stoi(arg(a, "suffix", "24")), repeats = std::stoi(arg(a, "repeats", "10"));
    const int decode = std::stoi(arg(a, "decode", "64"));
    const int longest = *std::max_element(contexts.begin(), contexts.end());
    Peer p(arg(a, "model", nullptr), std::stoi(arg(a, "ngl", "99")), std::stoi(arg(a, "threads", "2")),
           static_cast<uint32_t>(longest + suffix + decode + 16), std::stoul(arg(a, "ubatch", "2048")),
           kv_type(arg(a, "kv", "f16")));
    const std::string out = arg(a, "out", nullptr);
    std::string rows;
    for (int c : contexts) {
        rows += (rows.empty() ? "" : ", ") + bench_context(p, all, c, suffix, repeats, decode);
        write_json(out, "{" + header(p) + ", \"repeats\": " + std::to_string(repeats) + ", \"rows\": [" + rows + "]}");
        std::fprintf(stderr, "peer_timing: context %d done\n", c);
    }
    return 0;
}

int run_fidelity(const std::map<std::string, std::string> & a) {
    const Tokens prompt = read_tokens(arg(a, "prompt", nullptr)), forced = read_tokens(arg(a, "forced", nullptr));
    Peer p(arg(a, "model", nullptr), std::stoi(arg(a, "ngl", "0")), std::stoi(arg(a, "threads", "2")),
           static_cast<uint32_t>(prompt.size() + forced.size() + 16), std::stoul(arg(a, "ubatch", "512")),
           kv_type(arg(a, "kv", "f32")));
    std::ofstream logits(arg(a, "logits", nullptr), std::ios::binary);
    auto dump = [&] { logits.write(reinterpret_cast<const char *>(p.logits()), sizeof(float) * p.n_vocab); };
    p.clear();                                                     // teacher forcing along `forced`
    p.feed(prompt.data(), prompt.size());
    dump();
    for (llama_token t : forced) { p.feed(&t, 1); dump(); }
    if (!logits) fail("cannot write the logits file");
    p.clear();                                                     // llama.cpp's own greedy continuation
    p.feed(prompt.data(), prompt.size());
    std::string free_run;
    for (size_t i = 0; i < forced.size(); ++i) {
        llama_token t = p.argmax();
        free_run += (i ? ", " : "") + std::to_string(t);
        p.feed(&t, 1);
    }
    write_json(arg(a, "out", nullptr), "{" + header(p) + ", \"rows\": " + std::to_string(forced.size() + 1) +
                                           ", \"greedy_tokens\": [" + free_run + "]}");
    return 0;
}

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN || std::getenv("PEER_VERBOSE")) std::fputs(text, stderr);
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 2) fail("usage: peer_timing bench|fidelity --model M.gguf ...");
    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    const std::string mode = argv[1];
    const auto args = parse_args(argc, argv);
    int rc = mode == "bench" ? run_bench(args) : mode == "fidelity" ? run_fidelity(args) : (fail("unknown mode " + mode), 2);
    llama_backend_free();
    return rc;
}
