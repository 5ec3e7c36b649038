#include "progress.h"

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

namespace sparsekv::bench {
namespace {

struct State {
  std::mutex mu;
  std::condition_variable cv;
  std::thread ticker;
  bool running = false;
  std::string command, note;
  std::chrono::steady_clock::time_point start;
};

State& S() {
  static State* s = new State;  // never destroyed: the ticker may outlive static destruction
  return *s;
}

void Draw(const std::string& command, const std::string& note, double secs) {
  std::string line = "\r\033[K" + command;
  if (!note.empty()) line += ": " + note;
  char tail[32];
  std::snprintf(tail, sizeof tail, " (%.0f s)", secs);
  line += tail;
  (void)!write(STDERR_FILENO, line.data(), line.size());
}

}  // namespace

void ProgressStart(std::string command) {
  if (!isatty(STDERR_FILENO)) return;
  ProgressStop();
  State& s = S();
  std::lock_guard l(s.mu);
  s.command = std::move(command);
  s.note.clear();
  s.start = std::chrono::steady_clock::now();
  s.running = true;
  s.ticker = std::thread([&s] {
    std::unique_lock l(s.mu);
    while (s.running) {
      Draw(s.command, s.note, std::chrono::duration<double>(std::chrono::steady_clock::now() - s.start).count());
      s.cv.wait_for(l, std::chrono::milliseconds(200));
    }
    const char clear[] = "\r\033[K";
    (void)!write(STDERR_FILENO, clear, sizeof clear - 1);
  });
}

void ProgressNote(std::string note) {
  State& s = S();
  std::lock_guard l(s.mu);
  s.note = std::move(note);
}

void ProgressStop() {
  State& s = S();
  std::thread t;
  {
    std::lock_guard l(s.mu);
    if (!s.running) return;
    s.running = false;
    t = std::move(s.ticker);
  }
  s.cv.notify_all();
  if (t.joinable()) t.join();
}

bool ProgressActive() {
  State& s = S();
  std::lock_guard l(s.mu);
  return s.running;
}

}  // namespace sparsekv::bench
