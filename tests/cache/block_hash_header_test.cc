// block_hash.h compiles on its own: it is the first and only sparsekv include here.
#include <gtest/gtest.h>

#include "sparsekv/block_hash.h"

TEST(PublicHeaders, BlockHash) {
  SUCCEED();
}
