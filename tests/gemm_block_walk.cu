// Host code only (runs without a GPU): BlockWalk, the countdown both int8 GEMMs use
// to find each block of K's scales, gives the index a division would, min(block /
// per, last), for every block from wherever a walk starts.  Built and run by
// test_build_support.py.
#include <algorithm>
#include <cstdio>

#include "gemm_s8.cuh"

int main() {
    int wrong = 0, walks = 0;
    for (int per = 1; per <= 6; ++per)
        for (int last = -1; last <= 8; ++last)      // -1: no scales along K (never read)
            for (int start = 0; start <= 3 * per + 2; ++start, ++walks) {
                qd::BlockWalk walk(per, last, start);
                for (int block = start; block < start + 8 * per + 5; ++block, walk.next()) {
                    const int want = std::min(block / per, last);
                    if (walk.index != want && wrong++ < 5)
                        std::printf("per %d, last %d, from block %d: block %d takes scale %d, not %d\n", per,
                                    last, start, block, walk.index, want);
                }
            }
    if (!wrong) std::printf("%d walks, each on the scales a division finds\n", walks);
    return wrong ? 1 : 0;
}
