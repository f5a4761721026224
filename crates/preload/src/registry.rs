//! A fixed-capacity map from a verbs object's address to the shaper's state for it, read
//! without locks.
//!
//! Every post and poll looks its QP or CQ up here, so a lookup is a multiplicative hash and
//! a short linear probe over atomics. Writers (create and destroy calls, which are rare)
//! serialise on a mutex. Values are `Arc`s stored as raw pointers; a lookup borrows one
//! without touching its reference count, which is sound because a removed value is handed
//! back to the remover, who keeps it alive until no reader can hold it (see
//! [`crate::engine`]: until the owning device context is closed).

use std::marker::PhantomData;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const EMPTY: usize = 0;
const TOMBSTONE: usize = 1;

struct Slot {
    key: AtomicUsize,
    value: AtomicPtr<()>,
}

/// A map of `N` slots (a power of two) from object addresses to `Arc<T>`, with lock-free
/// lookups. The slots are a plain array, so a `static` map lives in zeroed memory and a
/// lookup needs no initialisation check.
pub struct PtrMap<T, const N: usize> {
    slots: [Slot; N],
    writer: Mutex<()>,
    _values: PhantomData<Arc<T>>,
}

// SAFETY: values are Arc<T> shared between threads; T must be Send + Sync for that.
unsafe impl<T: Send + Sync, const N: usize> Sync for PtrMap<T, N> {}
// SAFETY: as above.
unsafe impl<T: Send + Sync, const N: usize> Send for PtrMap<T, N> {}

impl<T, const N: usize> Default for PtrMap<T, N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T, const N: usize> PtrMap<T, N> {
    const MASK: usize = {
        assert!(N.is_power_of_two() && N > 1);
        N - 1
    };
    const SHIFT: u32 = usize::BITS - N.trailing_zeros();

    /// An empty map.
    pub const fn new() -> Self {
        PtrMap {
            slots: [const {
                Slot {
                    key: AtomicUsize::new(EMPTY),
                    value: AtomicPtr::new(ptr::null_mut()),
                }
            }; N],
            writer: Mutex::new(()),
            _values: PhantomData,
        }
    }

    #[inline(always)]
    fn home(key: usize) -> usize {
        // Fibonacci hashing of the address without its always-zero low bits.
        (key >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> Self::SHIFT
    }

    #[inline(always)]
    fn slot(&self, i: usize) -> &Slot {
        // The mask keeps the index in bounds.
        &self.slots[i & Self::MASK]
    }

    /// The value for `key`, borrowed without its reference count.
    ///
    /// The pointer stays valid while the value is in the map, and after removal for as
    /// long as the remover keeps the returned `Arc`.
    #[inline(always)]
    pub fn get(&self, key: *const ()) -> Option<NonNull<T>> {
        let key = key as usize;
        let i = Self::home(key);
        let slot = self.slot(i);
        if slot.key.load(Ordering::Acquire) == key {
            return NonNull::new(slot.value.load(Ordering::Acquire).cast::<T>());
        }
        self.probe(key, i)
    }

    /// The value for `key` if it sits in its home slot (almost always: the map is sparse),
    /// else `None`; callers fall back to [`Self::get`]. Lets a hot path avoid any call.
    #[inline(always)]
    pub fn get_at_home(&self, key: *const ()) -> Option<NonNull<T>> {
        let key = key as usize;
        let slot = self.slot(Self::home(key));
        if slot.key.load(Ordering::Acquire) == key {
            return NonNull::new(slot.value.load(Ordering::Acquire).cast::<T>());
        }
        None
    }

    /// The rest of a lookup whose home slot held another key.
    #[cold]
    #[inline(never)]
    fn probe(&self, key: usize, home: usize) -> Option<NonNull<T>> {
        for i in home..home + N {
            let slot = self.slot(i);
            let k = slot.key.load(Ordering::Acquire);
            if k == key {
                return NonNull::new(slot.value.load(Ordering::Acquire).cast::<T>());
            }
            if k == EMPTY {
                return None;
            }
        }
        None
    }

    /// Calls `f` with every value in the map.
    ///
    /// # Safety
    /// No value may be removed and freed meanwhile: the caller is the only thread that can
    /// touch the map (a child just forked, whose other threads are gone).
    pub unsafe fn for_each(&self, mut f: impl FnMut(&T)) {
        for slot in &self.slots {
            // SAFETY: a value in the map is a live Arc<T> (guaranteed by the caller).
            if let Some(v) = unsafe { slot.value.load(Ordering::Acquire).cast::<T>().as_ref() } {
                f(v);
            }
        }
    }

    /// The value for `key`, with a new reference.
    pub fn get_arc(&self, key: *const ()) -> Option<Arc<T>> {
        let _w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let p = self.get(key)?;
        // SAFETY: p came from Arc::into_raw and is still in the map (the writer lock keeps
        // it from being removed meanwhile), so its strong count is at least one.
        unsafe {
            Arc::increment_strong_count(p.as_ptr());
            Some(Arc::from_raw(p.as_ptr()))
        }
    }

    /// Inserts or replaces the value for `key`; returns the replaced value. Fails (handing
    /// the value back) when the map is full or `key` is null.
    pub fn insert(&self, key: *const (), value: Arc<T>) -> Result<Option<Arc<T>>, Arc<T>> {
        let key = key as usize;
        if key == EMPTY || key == TOMBSTONE {
            return Err(value);
        }
        let _w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let mut free = None;
        let start = Self::home(key);
        for i in start..start + N {
            let slot = self.slot(i);
            let k = slot.key.load(Ordering::Relaxed);
            if k == key {
                let new = Arc::into_raw(value).cast_mut().cast::<()>();
                let old = slot.value.swap(new, Ordering::AcqRel);
                // SAFETY: old came from Arc::into_raw in an earlier insert.
                return Ok(
                    NonNull::new(old.cast::<T>()).map(|p| unsafe { Arc::from_raw(p.as_ptr()) })
                );
            }
            if k == TOMBSTONE && free.is_none() {
                free = Some(i);
            }
            if k == EMPTY {
                free.get_or_insert(i);
                break;
            }
        }
        let Some(at) = free else {
            return Err(value);
        };
        let slot = self.slot(at);
        // The value first, then the key: a reader that sees the key sees the value.
        slot.value.store(
            Arc::into_raw(value).cast_mut().cast::<()>(),
            Ordering::Release,
        );
        slot.key.store(key, Ordering::Release);
        Ok(None)
    }

    /// Removes the value for `key` if it is `expected` (so that a stale remove cannot take
    /// out a newer object at a reused address) and returns it.
    pub fn remove(&self, key: *const (), expected: NonNull<T>) -> Option<Arc<T>> {
        let key = key as usize;
        let _w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let start = Self::home(key);
        for i in start..start + N {
            let slot = self.slot(i);
            let k = slot.key.load(Ordering::Relaxed);
            if k == key {
                let v = slot.value.load(Ordering::Relaxed);
                if v.cast::<T>() != expected.as_ptr() {
                    return None;
                }
                slot.value.store(ptr::null_mut(), Ordering::Release);
                slot.key.store(TOMBSTONE, Ordering::Release);
                // SAFETY: v came from Arc::into_raw in insert and is no longer in the map.
                return Some(unsafe { Arc::from_raw(v.cast::<T>()) });
            }
            if k == EMPTY {
                return None;
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn insert_get_replace_remove() {
        let map: PtrMap<u32, 16> = PtrMap::new();
        let k = 0x1000 as *const ();
        assert!(map.get(k).is_none());
        assert!(map.insert(k, Arc::new(1)).unwrap().is_none());
        // SAFETY: the value is in the map.
        assert_eq!(unsafe { *map.get(k).unwrap().as_ref() }, 1);
        let old = map.insert(k, Arc::new(2)).unwrap().unwrap();
        assert_eq!(*old, 1);
        let cur = map.get(k).unwrap();
        assert!(
            map.remove(k, NonNull::from(&*old)).is_none(),
            "stale remove"
        );
        assert_eq!(*map.remove(k, cur).unwrap(), 2);
        assert!(map.get(k).is_none());
        assert_eq!(*map.get_arc(k).unwrap_or_else(|| Arc::new(0)), 0);
    }

    #[test]
    fn colliding_keys_probe_past_tombstones_and_the_map_fills_up() {
        let map: PtrMap<usize, 8> = PtrMap::new();
        let keys: Vec<*const ()> = (1..=8).map(|i| (i * 0x40) as *const ()).collect();
        for (i, &k) in keys.iter().enumerate() {
            assert!(map.insert(k, Arc::new(i)).is_ok());
        }
        assert!(
            map.insert(0x0009_9990 as *const (), Arc::new(99)).is_err(),
            "full"
        );
        let third = map.get(keys[2]).unwrap();
        assert!(map.remove(keys[2], third).is_some());
        for (i, &k) in keys.iter().enumerate().filter(|(i, _)| *i != 2) {
            // SAFETY: the value is in the map.
            assert_eq!(unsafe { *map.get(k).unwrap().as_ref() }, i);
        }
        assert!(
            map.insert(keys[2], Arc::new(22)).is_ok(),
            "tombstone reused"
        );
        // SAFETY: the value is in the map.
        assert_eq!(unsafe { *map.get(keys[2]).unwrap().as_ref() }, 22);
        assert!(map.insert(std::ptr::null(), Arc::new(0)).is_err());
    }
}
