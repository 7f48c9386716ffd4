// Runs the kernels of kernels/lz4.cu under cuda_emu.h (blocks of 128 threads, lanes as fibers).
//   lz4_emu compress PAGES MAX_OUT OUT      OUT: n u32 lengths, then n 4096-byte slots
//   lz4_emu decompress INPUTS INDEX OUT     INDEX: n u32 offsets, n u32 lengths;
//                                           OUT: n u32 statuses, then n 4096-byte pages
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda_emu.h"

extern "C" void lz4_compress_pages(const uint4 *pages, unsigned char *out,
                                   unsigned int *out_lens, unsigned int n_pages,
                                   unsigned int max_out);
extern "C" void lz4_decompress_pages(const unsigned char *inputs,
                                     const unsigned int *in_offsets,
                                     const unsigned int *in_lens, uint4 *out,
                                     unsigned int *status, unsigned int n_pages);

static std::vector<unsigned char> read_file(const char *path) {
    std::vector<unsigned char> data;
    FILE *f = std::fopen(path, "rb");
    if (!f) { std::perror(path); std::exit(2); }
    unsigned char buf[65536];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) data.insert(data.end(), buf, buf + n);
    std::fclose(f);
    return data;
}

static void write_file(const char *path, const void *a, size_t na, const void *b, size_t nb) {
    FILE *f = std::fopen(path, "wb");
    if (!f || std::fwrite(a, 1, na, f) != na || std::fwrite(b, 1, nb, f) != nb) {
        std::perror(path);
        std::exit(2);
    }
    std::fclose(f);
}

static void launch(unsigned int n_pages, std::function<void()> kernel) {
    emu_launch((n_pages + 3) / 4, kernel);
}

int main(int argc, char **argv) {
    if (argc == 5 && std::strcmp(argv[1], "compress") == 0) {
        std::vector<unsigned char> pages = read_file(argv[2]);
        unsigned int n = pages.size() / 4096, max_out = std::strtoul(argv[3], nullptr, 10);
        std::vector<uint4> aligned(n * 256);
        std::memcpy(aligned.data(), pages.data(), n * 4096);
        std::vector<unsigned char> out(n * 4096, 0);
        std::vector<unsigned int> lens(n, 0);
        launch(n, [&] { lz4_compress_pages(aligned.data(), out.data(), lens.data(), n, max_out); });
        write_file(argv[4], lens.data(), n * 4, out.data(), out.size());
        return 0;
    }
    if (argc == 5 && std::strcmp(argv[1], "decompress") == 0) {
        std::vector<unsigned char> inputs = read_file(argv[2]);
        std::vector<unsigned char> index_bytes = read_file(argv[3]);
        unsigned int n = index_bytes.size() / 8;
        std::vector<unsigned int> index(2 * n);
        std::memcpy(index.data(), index_bytes.data(), 8 * n);
        std::vector<uint4> out(n * 256);
        std::memset(out.data(), 0, n * 4096);
        std::vector<unsigned int> status(n, 0);
        launch(n, [&] {
            lz4_decompress_pages(inputs.data(), index.data(), index.data() + n, out.data(),
                                 status.data(), n);
        });
        write_file(argv[4], status.data(), n * 4, out.data(), n * 4096);
        return 0;
    }
    std::fprintf(stderr, "usage: lz4_emu compress PAGES MAX_OUT OUT | decompress INPUTS INDEX OUT\n");
    return 2;
}
