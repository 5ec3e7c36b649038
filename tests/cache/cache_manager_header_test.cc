// cache_manager.h compiles on its own: it is the first and only sparsekv include here.
#include <gtest/gtest.h>

#include "sparsekv/cache_manager.h"

TEST(PublicHeaders, CacheManager) {
  SUCCEED();
}
