// kv_events.h compiles on its own: it is the first and only sparsekv include here.
#include <gtest/gtest.h>

#include "sparsekv/kv_events.h"

TEST(PublicHeaders, KvEvents) {
  SUCCEED();
}
