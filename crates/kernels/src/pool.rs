//! The compute pool the kernels' parallel loops run on: the calling thread and `threads - 1`
//! workers that spin between loops and sleep only after a quiet spell.
//!
//! Written here rather than using rayon, which the kernels used before: a decode step of a
//! small model runs a few hundred short loops (each weight product of a 576-wide model is
//! tens of microseconds), separated by serial work (norms, rope, sampling) that is long
//! enough for rayon's idle workers to fall asleep. Each loop then waits for a sleeping worker
//! to be woken, and for the share of the loop that worker took; measured with `bench step` on
//! SmolLM2 at batch 1, that waiting was a third of the step. Here the workers keep polling
//! for [`SPIN`] after each loop, so the next one starts on every thread at once, as
//! llama.cpp's thread pool does between the nodes of a graph. No crate we depend on offers a
//! pool with that behaviour on stable Rust (rayon's spin time is fixed and short).
//!
//! Tasks are claimed from an atomic counter, so the split adapts to a thread that was
//! descheduled. One loop runs at a time: a loop started while another is running (another
//! engine's thread, or a task that starts a loop of its own) runs on its caller's thread
//! alone, which keeps every thread busy without waiting.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a worker keeps polling for the next loop before it sleeps: longer than the
/// serial stretches inside a forward pass, short enough that an idle server does not burn a
/// core.
const SPIN: Duration = Duration::from_micros(500);
/// Polls between clock reads and yields while spinning.
const POLLS_PER_CHECK: u32 = 64;
/// Environment variables that set the pool's threads, in order (the CLI's `--threads` sets
/// the first).
pub const THREADS_ENV: [&str; 2] = ["SWITCHYARD_THREADS", "RAYON_NUM_THREADS"];

/// One parallel loop: `n` tasks of `f`, claimed through `next`.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    panicked: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

impl Job<'_> {
    /// Runs tasks until none is left.
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.n {
                return;
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.f)(i))) {
                if let Ok(mut slot) = self.panicked.lock() {
                    slot.get_or_insert(p);
                }
            }
            self.done.fetch_add(1, Ordering::Release);
        }
    }
}

struct Shared {
    /// The running loop (`null` between loops); its lifetime is the caller's frame, which
    /// waits until no worker is inside it.
    job: AtomicPtr<Job<'static>>,
    /// Bumped for every loop started.
    epoch: AtomicU64,
    /// Workers between announcing themselves and leaving the current loop.
    inside: AtomicUsize,
    sleepers: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
    stop: AtomicBool,
}

/// The pool: its workers and the lock that lets one loop run at a time.
pub struct Pool {
    shared: Arc<Shared>,
    threads: usize,
    running: Mutex<()>,
}

impl Pool {
    /// A pool computing on `threads` threads: the caller and `threads - 1` workers.
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            job: AtomicPtr::new(std::ptr::null_mut()),
            epoch: AtomicU64::new(0),
            inside: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let mut started = 1;
        for i in 1..threads {
            let s = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("switchyard-compute-{i}"))
                .spawn(move || worker(&s));
            match spawned {
                Ok(_) => started += 1,
                Err(e) => {
                    tracing::warn!(error = %e, "compute pool: a worker thread could not start");
                    break;
                }
            }
        }
        Self {
            shared,
            threads: started,
            running: Mutex::new(()),
        }
    }

    /// Threads a loop runs on (the caller included).
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Calls `f(i)` for every `i` in `0..n`, spread over the pool's threads, and returns
    /// when all have returned. A panic in a task is re-raised here, after every other task
    /// has finished.
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) {
        if n == 0 {
            return;
        }
        let guard = match self.running.try_lock() {
            Ok(g) if n > 1 && self.threads > 1 => g,
            _ => {
                (0..n).for_each(f);
                return;
            }
        };
        let job = Job {
            f,
            n,
            next: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            panicked: Mutex::new(None),
        };
        let s = &*self.shared;
        // SAFETY (lifetime erasure): the pointer is withdrawn below, and this frame waits
        // until no worker is inside the job, before `job` goes out of scope.
        let ptr = (&job as *const Job<'_>).cast::<Job<'static>>().cast_mut();
        s.job.store(ptr, Ordering::SeqCst);
        s.epoch.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.park.lock();
            s.wake.notify_all();
        }
        job.work();
        while job.done.load(Ordering::Acquire) < n {
            std::hint::spin_loop();
        }
        s.job.store(std::ptr::null_mut(), Ordering::SeqCst);
        while s.inside.load(Ordering::SeqCst) != 0 {
            std::hint::spin_loop();
        }
        drop(guard);
        let panicked = job.panicked.lock().ok().and_then(|mut p| p.take());
        if let Some(p) = panicked {
            resume_unwind(p);
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _l = self.shared.park.lock();
        self.shared.wake.notify_all();
    }
}

fn worker(s: &Shared) {
    let mut seen = s.epoch.load(Ordering::SeqCst);
    loop {
        // Wait for a loop newer than the last one seen: poll, then sleep.
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            if s.stop.load(Ordering::Relaxed) {
                return;
            }
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            polls += 1;
            if !polls.is_multiple_of(POLLS_PER_CHECK) {
                std::hint::spin_loop();
                continue;
            }
            if start.elapsed() < SPIN {
                // Let another thread that wants this core run; we come back at once if not.
                std::thread::yield_now();
                continue;
            }
            let Ok(mut g) = s.park.lock() else {
                return;
            };
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while s.epoch.load(Ordering::SeqCst) == seen && !s.stop.load(Ordering::SeqCst) {
                g = match s.wake.wait_timeout(g, Duration::from_millis(100)) {
                    Ok((g, _)) => g,
                    Err(_) => return,
                };
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(g);
            polls = 0;
        }
        s.inside.fetch_add(1, Ordering::SeqCst);
        let p = s.job.load(Ordering::SeqCst);
        if !p.is_null() {
            // SAFETY: the caller keeps the job alive until `inside` is back to zero, and
            // withdraws the pointer before waiting for that (see `Pool::run`).
            unsafe { &*p }.work();
        }
        s.inside.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Threads from the environment ([`THREADS_ENV`]), else every core.
fn configured_threads() -> usize {
    THREADS_ENV
        .iter()
        .find_map(|k| std::env::var(k).ok()?.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The process's pool, started on first use with [`configured_threads`].
pub fn global() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool::new(configured_threads()))
}

/// [`Pool::run`] on the process's pool.
pub fn run(n: usize, f: &(dyn Fn(usize) + Sync)) {
    global().run(n, f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_on_every_pool_size() {
        for threads in [1, 2, 3, 5] {
            let pool = Pool::new(threads);
            assert_eq!(pool.threads(), threads);
            for n in [0, 1, 2, 7, 100, 1000] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "{threads} {n}"
                );
            }
        }
    }

    #[test]
    fn loops_after_a_quiet_spell_wake_the_workers() {
        let pool = Pool::new(2);
        let count = AtomicUsize::new(0);
        for _ in 0..3 {
            std::thread::sleep(SPIN * 4);
            pool.run(64, &|_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(count.load(Ordering::Relaxed), 192);
    }

    #[test]
    fn a_loop_inside_a_task_runs_on_its_thread() {
        let pool = Pool::new(2);
        let count = AtomicUsize::new(0);
        pool.run(4, &|_| {
            pool.run(8, &|_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(count.load(Ordering::Relaxed), 32);
    }

    #[test]
    fn concurrent_callers_each_finish_their_loop() {
        let pool = Pool::new(2);
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..50 {
                        pool.run(33, &|_| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 4 * 50 * 33);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_after_the_others() {
        let pool = Pool::new(2);
        let count = AtomicUsize::new(0);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(16, &|i| {
                if i == 5 {
                    panic!("task 5");
                }
                count.fetch_add(1, Ordering::Relaxed);
            })
        }));
        assert!(r.is_err());
        assert_eq!(count.load(Ordering::Relaxed), 15);
        // The pool still works.
        pool.run(4, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 19);
    }
}
