//! The queue between the worker's control loop and its slots: the control loop pushes the tasks
//! the scheduler assigns, and one long-lived thread per slot pops them and runs them one after
//! another. A slot that finishes a task takes the next queued one on the same thread, without a
//! thread hand-off per task (no blocking-pool spawn, no wake-up while tasks are queued).

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard};

/// A FIFO shared by the slots' threads; closing it ends them.
pub struct SlotQueue<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
}

struct State<T> {
    items: VecDeque<T>,
    closed: bool,
    /// Threads asleep in `pop` that no push has woken yet: a push wakes only as many as it has
    /// items for, and takes them off this count itself, so that pushes in quick succession do
    /// not wake the same sleepers again (a wake-up is a system call even when nobody sleeps).
    /// A thread woken spuriously counts again when it goes back to sleep: the count may exceed
    /// the sleepers (a wasted wake-up later), never fall short of them.
    waiting: usize,
}

impl<T> Default for SlotQueue<T> {
    fn default() -> Self {
        SlotQueue {
            state: Mutex::new(State {
                items: VecDeque::new(),
                closed: false,
                waiting: 0,
            }),
            ready: Condvar::new(),
        }
    }
}

impl<T> SlotQueue<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // The state is a queue of plain values, consistent between any two statements.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Queues `items` behind the others, in order, waking as many waiting threads as they keep
    /// busy; false (the items dropped) once the queue is closed.
    pub fn push(&self, items: impl IntoIterator<Item = T>) -> bool {
        let mut state = self.lock();
        if state.closed {
            return false;
        }
        let before = state.items.len();
        state.items.extend(items);
        let wake = state.waiting.min(state.items.len() - before);
        state.waiting -= wake;
        drop(state);
        for _ in 0..wake {
            self.ready.notify_one();
        }
        true
    }

    /// The oldest queued item, waiting for one; `None` once the queue is closed (items still
    /// queued then are dropped: their worker is going away).
    pub fn pop(&self) -> Option<T> {
        let mut state = self.lock();
        loop {
            if state.closed {
                return None;
            }
            if let Some(item) = state.items.pop_front() {
                return Some(item);
            }
            state.waiting += 1;
            state = self
                .ready
                .wait(state)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
    }

    /// Ends every `pop`, now and later, and drops what is queued.
    pub fn close(&self) {
        let mut state = self.lock();
        state.closed = true;
        state.items.clear();
        drop(state);
        self.ready.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;

    /// `slots` threads asleep in `pop`, each taking one item and then staying busy (never
    /// popping again); what each took arrives on the returned channel.
    fn sleeping_slots(
        queue: &Arc<SlotQueue<u32>>,
        slots: usize,
    ) -> std::sync::mpsc::Receiver<Option<u32>> {
        let (taken, took) = std::sync::mpsc::channel();
        for _ in 0..slots {
            let (queue, taken) = (queue.clone(), taken.clone());
            std::thread::spawn(move || taken.send(queue.pop()));
        }
        while queue.lock().waiting < slots {
            std::thread::sleep(Duration::from_millis(1));
        }
        took
    }

    /// What the first `slots` slots to wake took, sorted.
    fn woken(took: &std::sync::mpsc::Receiver<Option<u32>>, slots: usize) -> Vec<Option<u32>> {
        let mut got: Vec<_> = (0..slots)
            .map(|_| {
                took.recv_timeout(Duration::from_secs(5))
                    .expect("a slot woke")
            })
            .collect();
        got.sort();
        got
    }

    #[test]
    fn items_come_out_in_order() {
        let queue = SlotQueue::default();
        assert!(queue.push([0, 1]));
        assert!(queue.push(2..5));
        let popped: Vec<_> = (0..5).filter_map(|_| queue.pop()).collect();
        assert_eq!(popped, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn every_item_is_taken_by_exactly_one_of_several_slots() {
        let queue = Arc::new(SlotQueue::<usize>::default());
        let taken: Arc<Vec<AtomicUsize>> =
            Arc::new((0..10_000).map(|_| AtomicUsize::new(0)).collect());
        let slots: Vec<_> = (0..4)
            .map(|_| {
                let (queue, taken) = (queue.clone(), taken.clone());
                std::thread::spawn(move || {
                    while let Some(i) = queue.pop() {
                        taken[i].fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for i in 0..10_000 {
            assert!(queue.push([i]));
            if i % 1000 == 0 {
                // Let the slots drain the queue and wait, so pushes also wake sleeping slots.
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        while taken
            .iter()
            .map(|t| t.load(Ordering::Relaxed))
            .sum::<usize>()
            < 10_000
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        queue.close();
        for slot in slots {
            slot.join().unwrap();
        }
        let counts: Vec<_> = taken.iter().map(|t| t.load(Ordering::Relaxed)).collect();
        assert!(counts.iter().all(|&c| c == 1), "each item taken once");
    }

    #[test]
    fn several_items_pushed_at_once_wake_as_many_waiting_slots() {
        let queue = Arc::new(SlotQueue::<u32>::default());
        let took = sleeping_slots(&queue, 3);
        assert!(queue.push([1, 2, 3]));
        assert_eq!(woken(&took, 3), vec![Some(1), Some(2), Some(3)]);
        queue.close();
    }

    #[test]
    fn a_push_wakes_each_sleeper_once_however_soon_the_next_push_comes() {
        let queue = Arc::new(SlotQueue::<u32>::default());
        let took = sleeping_slots(&queue, 2);
        // Each push takes the sleeper it wakes off the count at once, before that one runs:
        // the next push wakes the other sleeper, not the same one again.
        assert!(queue.push([1]));
        assert_eq!(queue.lock().waiting, 1);
        assert!(queue.push([2]));
        assert_eq!(queue.lock().waiting, 0);
        assert!(queue.push([3]), "nobody left to wake: it waits for a slot");
        assert_eq!(woken(&took, 2), vec![Some(1), Some(2)]);
        assert_eq!(queue.pop(), Some(3));
    }

    #[test]
    fn closing_ends_waiting_slots_and_refuses_more() {
        let queue = Arc::new(SlotQueue::<u32>::default());
        let waiter = {
            let queue = queue.clone();
            std::thread::spawn(move || queue.pop())
        };
        std::thread::sleep(Duration::from_millis(20));
        queue.close();
        assert_eq!(waiter.join().unwrap(), None);
        assert!(!queue.push([1]), "a closed queue takes nothing");
        assert_eq!(queue.pop(), None);
    }

    #[test]
    fn closing_drops_what_is_queued() {
        let queue = SlotQueue::default();
        assert!(queue.push(["never run"]));
        queue.close();
        assert_eq!(queue.pop(), None);
    }
}
