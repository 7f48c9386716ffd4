//! The daemon's list space (`mem::reserve_list_space`), in a process of its own: once it is
//! reserved, a bookkeeping list that outgrows the heap and goes on growing makes no mapping,
//! and one dropped gives its pages back.

use trueno_ublk::mem::{empty_list, reserve_list_space, ListAlloc, ListVec};
use trueno_ublk::os::smaps_mapping_range;

/// The mappings of this process, as `(start, end)`, from /proc/self/smaps, each with its
/// resident KiB.
fn mappings() -> Vec<((usize, usize), u64)> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
    let mut found = Vec::new();
    for line in smaps.lines() {
        if let Some(kib) = line.strip_prefix("Rss:") {
            let kib = kib.trim().trim_end_matches("kB").trim().parse().unwrap();
            if let Some((_, rss)) = found.last_mut() {
                *rss = kib;
            }
        } else if let Some(range) = smaps_mapping_range(line) {
            let address = |at: u64| usize::try_from(at).unwrap();
            found.push(((address(range.start), address(range.end)), 0));
        }
    }
    found
}

/// The mapping holding `address`, with its resident KiB.
fn mapping_at(address: usize) -> ((usize, usize), u64) {
    mappings()
        .into_iter()
        .find(|&((start, end), _)| start <= address && address < end)
        .unwrap()
}

#[test]
fn a_list_grows_past_the_heap_without_a_mapping_and_gives_its_pages_back() {
    let overcommit = std::fs::read_to_string("/proc/sys/vm/overcommit_memory").unwrap();
    if overcommit.trim() == "2" {
        assert!(
            !reserve_list_space().unwrap(),
            "no space under strict overcommit"
        );
        return;
    }
    assert!(reserve_list_space().unwrap());
    let mut list: ListVec<u64> = empty_list(ListAlloc::Mapped);
    list.push(0);
    let before = mappings().len();
    // From the heap into a window, then within it: 32 MiB, pushed one entry at a time.
    let entries = 4 << 20;
    for value in 1..entries {
        list.push(value);
    }
    assert_eq!(mappings().len(), before, "growing made no mapping");
    assert!(list.iter().enumerate().all(|(i, &v)| v == i as u64));
    let ((start, end), resident_kib) = mapping_at(list.as_ptr() as usize);
    assert!(end - start >= 1 << 36, "in the space's 64 GiB mapping");
    assert!(resident_kib >= 32 << 10, "{resident_kib} KiB resident");
    drop(list);
    let (range, resident_kib) = mapping_at(start);
    assert_eq!(range, (start, end), "dropping it unmapped nothing");
    assert!(resident_kib < 1 << 10, "{resident_kib} KiB still resident");
}
