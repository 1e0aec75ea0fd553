// bench_nvme: the NVMe tier against fio, same code as `strata bench nvme`.
//
//   build-nvme/bench/bench_nvme DIR [SIZE_MIB=1024] [BLOCK_KIB=1024] [DEPTH=16] [THREADS=1] [RUNS=3] [uring|posix]
//
// Per run: engine write+read, then fio write+read (same engine, block, depth,
// size, O_DIRECT), RUNS times; prints medians and ratios.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "src/common/status_util.h"
#include "src/nvme/nvme_bench.h"

int main(int argc, char** argv) {
  using namespace strata::nvme;
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [SIZE_MIB] [BLOCK_KIB] [DEPTH] [THREADS] [RUNS] [uring|posix]\n", argv[0]);
    return 2;
  }
  NvmeBenchOptions o;
  o.paths = {argv[1]};
  o.size = (argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1024) << 20;
  o.io.block_size = (argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 1024) << 10;
  o.io.queue_depth = argc > 4 ? std::atoi(argv[4]) : 16;
  o.io.threads = argc > 5 ? std::atoi(argv[5]) : 1;
  int runs = argc > 6 ? std::atoi(argv[6]) : 3;
  o.io.engine = argc > 7 && std::string(argv[7]) == "posix" ? EngineKind::kPosix : EngineKind::kUring;
  std::vector<double> ew, er, fw, fr;
  const std::string fio_file = o.paths[0] + "/strata-fio-bench.bin";
  for (int i = 0; i < runs; ++i) {
    // engine write+read, then fio write+read (as `strata bench nvme`: each
    // tool reads what it has just written).
    auto session = EngineBenchSession::Open(o);
    CHECK_OK(session.status());
    auto w = (*session)->WritePass();
    CHECK_OK(w.status());
    auto rd = (*session)->ReadPass();
    CHECK_OK(rd.status());
    session->reset();
    auto fwr = RunFioPass(o, fio_file, "write");
    CHECK_OK(fwr.status());
    auto frd = RunFioPass(o, fio_file, "read");
    unlink(fio_file.c_str());
    CHECK_OK(frd.status());
    ew.push_back(*w);
    er.push_back(*rd);
    fw.push_back(*fwr);
    fr.push_back(*frd);
    std::printf("run %d: engine write %.3f read %.3f | fio write %.3f read %.3f GB/s\n", i, ew.back(), er.back(),
                fw.back(), fr.back());
  }
  std::printf("median: engine write %.3f read %.3f | fio write %.3f read %.3f GB/s | write_vs_fio %.3f read_vs_fio %.3f\n",
              Median(ew), Median(er), Median(fw), Median(fr), Median(ew) / Median(fw), Median(er) / Median(fr));
  return 0;
}
