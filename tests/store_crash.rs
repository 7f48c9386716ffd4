//! A store survives its process's death at any instruction: a child process writes, flushes
//! and discards in a shared store and is SIGKILLed at a random moment; this process then
//! resumes the store and checks every page against a model of what the child had done, and
//! the next child resumes it again and goes on. No page may be lost, torn or wrong.
//!
//! The child runs the recompressor too, with an idle threshold of a few milliseconds, so kills
//! also land between its copying a new object in, flipping an entry and freeing the old one.
//!
//! The child logs each operation before (`B`) and after (`E`) it: a page of an operation the
//! kill interrupted may hold its old or its new data (as a block device's would; the kernel
//! re-issues such a request after a recovery), every other page exactly what was last written.
//!
//! Two scenarios: small random operations over a one-group device without a chunk reserve, and
//! a device of five table groups with a reserve (so a refill thread), whose writes move from
//! group to group and whose discards now and then empty a whole group, so kills also land
//! while the refill thread commits chunks or table groups and while groups are given back.

mod store_common;

use std::collections::HashMap;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use store_common::{random_page, same_page, text_page, zero_page};
use trueno_ublk::codec::{Algorithm, PAGE_SIZE};
use trueno_ublk::store::{Backing, BatchedPageStore, Opened, RecompressConfig, StoreConfig};

const PAGE: u64 = PAGE_SIZE as u64;
const ROUNDS: u64 = 24;
const CHILD_ENV: &str = "TRUENO_STORE_CRASH_CHILD";
/// Pages of a table group (`store::layout`'s 2048), for the scenario that empties whole groups.
const GROUP_PAGES: u64 = 2048;
/// Table groups of the scenario that empties whole groups: more than the store's spares.
const GROUPS: u64 = 24;

/// What the child does, and to what store.
#[derive(Clone, Copy)]
enum Scenario {
    /// 1,024 pages, no chunk reserve: 1-4 pages anywhere, one operation in 8 a discard.
    Scattered,
    /// `GROUPS` table groups and a 1 MiB chunk reserve (a refill thread): 1-4 pages in one
    /// group at a time, one operation in 8 a discard, moving to the next group every 64
    /// operations and discarding the whole group as it leaves it but every eighth time. So
    /// groups 7, 15 and 23 keep pages, and groups 0-6, empty and not within the eight after
    /// one that holds pages (which the store keeps as spares), are committed and given back
    /// as the writes come and go.
    GroupWise,
}

impl Scenario {
    fn name(self) -> &'static str {
        match self {
            Self::Scattered => "scattered",
            Self::GroupWise => "group-wise",
        }
    }

    fn from_name(name: &str) -> Self {
        match name {
            "group-wise" => Self::GroupWise,
            _ => Self::Scattered,
        }
    }

    fn pages(self) -> u64 {
        match self {
            Self::Scattered => 1024,
            Self::GroupWise => GROUPS * GROUP_PAGES,
        }
    }

    /// The longest random moment after the chosen operation before the kill.
    fn kill_window(self) -> Duration {
        match self {
            Self::Scattered => Duration::from_millis(20),
            Self::GroupWise => Duration::from_millis(200),
        }
    }

    /// Operation `version`: whether it discards, its first page and its page count.
    fn operation(self, rng: &mut Rng, version: u64) -> (bool, u64, u64) {
        match self {
            Self::Scattered => {
                let first = rng.below(self.pages());
                let count = (1 + rng.below(4)).min(self.pages() - first);
                (rng.below(8) == 0, first, count)
            }
            Self::GroupWise => {
                let (turn, step) = (version / 64, version % 64);
                let group = turn % GROUPS;
                if step == 63 && turn % 8 != 7 {
                    return (true, group * GROUP_PAGES, GROUP_PAGES);
                }
                let first = group * GROUP_PAGES + rng.below(GROUP_PAGES - 4);
                (rng.below(8) == 0, first, 1 + rng.below(4))
            }
        }
    }
}

fn config(scenario: Scenario) -> StoreConfig {
    let mut c =
        trueno_ublk::config::StoreSettings::default().store_config(scenario.pages() * PAGE, false);
    if let Scenario::GroupWise = scenario {
        c.reserve_bytes = 1 << 20;
    }
    c.batch_threshold = 32;
    c.flush_timeout = Duration::from_millis(2);
    c.algorithm = Algorithm::Lz4;
    c.recompress = Some(RecompressConfig {
        algorithm: Algorithm::Zstd { level: 3 },
        idle: Duration::from_millis(16),
        min_saving_divisor: 8,
        cpu_percent: 100,
    });
    c
}

/// What page `index` holds after operation `version` wrote it: every kind of entry in turn
/// (zero, same-filled, compressible, incompressible).
fn content(index: u64, version: u64) -> Vec<u8> {
    match version % 4 {
        0 => zero_page().to_vec(),
        1 => same_page((index << 20) | version).to_vec(),
        2 => text_page(index * 1_000_003 + version).to_vec(),
        _ => random_page(index * 7_000_003 + version).to_vec(),
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The child: random writes and discards until killed, logging each to stdout unbuffered.
/// Run by the tests below only (ignored otherwise).
#[test]
#[ignore = "the child process of the kill -9 tests"]
fn crash_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut fields = spec.split(',');
    let scenario = Scenario::from_name(fields.next().unwrap());
    let mut numbers = fields.map(|f| f.parse::<u64>().unwrap());
    let (key, seed, first_version) = (
        i32::try_from(numbers.next().unwrap()).unwrap(),
        numbers.next().unwrap(),
        numbers.next().unwrap(),
    );
    let (store, _) =
        BatchedPageStore::open(config(scenario), None, Backing::SharedUnlocked { key }).unwrap();
    let _flusher = store.start_flusher(|_| {}).unwrap();
    let mut out = std::io::stdout().lock();
    let mut rng = Rng(seed | 1);
    for version in first_version.. {
        let (discard, first, count) = scenario.operation(&mut rng, version);
        if discard {
            writeln!(out, "B D {first} {count} {version}").unwrap();
            store.discard(first * PAGE, count * PAGE).unwrap();
        } else {
            writeln!(out, "B W {first} {count} {version}").unwrap();
            let data: Vec<u8> = (first..first + count)
                .flat_map(|i| content(i, version))
                .collect();
            store.write(first * PAGE, &data).unwrap();
        }
        writeln!(out, "E").unwrap();
        out.flush().unwrap();
        if rng.below(64) == 0 {
            store.flush_pending().unwrap();
        }
    }
}

/// Page index → version that last wrote it (`None`: zeros), and the pages of an interrupted
/// operation with the version they may hold instead.
#[derive(Default)]
struct Model {
    pages: HashMap<u64, Option<u64>>,
    maybe: HashMap<u64, Option<u64>>,
    last_version: u64,
}

impl Model {
    fn apply(&mut self, log: &str) {
        self.maybe.clear();
        let mut open: Option<(bool, u64, u64, u64)> = None;
        for line in log.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            match f[0] {
                "B" => {
                    let n = |i: usize| f[i].parse::<u64>().unwrap();
                    open = Some((f[1] == "W", n(2), n(3), n(4)));
                }
                "E" => {
                    let (write, first, count, version) = open.take().unwrap();
                    for i in first..first + count {
                        self.pages.insert(i, write.then_some(version));
                    }
                    self.last_version = version;
                }
                _ => {} // a line cut by the kill
            }
        }
        if let Some((write, first, count, version)) = open {
            for i in first..first + count {
                self.maybe.insert(i, write.then_some(version));
            }
            self.last_version = version;
        }
    }

    fn expected(v: Option<u64>, index: u64) -> Vec<u8> {
        v.map_or_else(|| vec![0u8; PAGE_SIZE], |v| content(index, v))
    }

    /// Check each of the `pages` pages of `store`; returns how many differ. A page of the
    /// interrupted operation holds its old or its new data, and keeps what it holds from now on.
    fn check(&mut self, store: &BatchedPageStore, pages: u64) -> usize {
        let mut bad = 0;
        let mut buf = vec![0u8; PAGE_SIZE];
        for index in 0..pages {
            store.read(index * PAGE, &mut buf).unwrap();
            let want = Self::expected(self.pages.get(&index).copied().flatten(), index);
            let maybe = self.maybe.get(&index).copied();
            let took_new = maybe.is_some_and(|v| buf == Self::expected(v, index));
            if took_new {
                self.pages.insert(index, maybe.flatten());
            }
            let ok = buf == want || took_new;
            if !ok {
                let held = (1..=self.last_version + 50).find(|&v| buf == content(index, v));
                eprintln!(
                    "page {index} differs from the model: want {:?} (or {:?}), holds version {held:?}, zeros {}",
                    self.pages.get(&index),
                    self.maybe.get(&index),
                    buf.iter().all(|&b| b == 0)
                );
                bad += 1;
            }
        }
        bad
    }
}

#[test]
fn survives_kill9_at_random_points() {
    survives_kill9(Scenario::Scattered, 0x7d00_0000);
}

#[test]
fn survives_kill9_while_table_groups_and_the_reserve_change() {
    survives_kill9(Scenario::GroupWise, 0x7d10_0000);
}

/// Rounds of a child of `scenario` killed and its store resumed and checked, in a segment of
/// a key made of `key_base` and this process's id (one per test: they run in parallel).
fn survives_kill9(scenario: Scenario, key_base: i32) {
    let key = key_base | i32::try_from(std::process::id() & 0xffff).unwrap();
    let _ = trueno_ublk::mem::Segment::remove_shared(key);
    let exe = std::env::current_exe().unwrap();
    let mut model = Model::default();
    let mut rng = Rng(0x5eed_1234_5678_9abc);
    let mut mismatches = 0;
    for round in 0..ROUNDS {
        let mut child = Command::new(&exe)
            .args(["--exact", "crash_child", "--ignored", "--nocapture", "-q"])
            .env(
                CHILD_ENV,
                format!(
                    "{},{key},{},{}",
                    scenario.name(),
                    rng.next(),
                    model.last_version + 1
                ),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .process_group(0)
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        // Kill after a random number of finished operations (a slow machine must not turn
        // rounds into kills during start-up), then a random moment more.
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let kill_after = 1 + rng.below(400);
        let reader = std::thread::spawn(move || {
            let mut log = String::new();
            let mut finished = 0;
            for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
                let Ok(line) = line else { break };
                if line == "E" {
                    finished += 1;
                    if finished == kill_after {
                        let _ = done_tx.send(());
                    }
                }
                log.push_str(&line);
                log.push('\n');
            }
            log
        });
        let _ = done_rx.recv_timeout(Duration::from_secs(20));
        let window = u64::try_from(scenario.kill_window().as_micros()).unwrap();
        std::thread::sleep(Duration::from_micros(rng.below(window)));
        child.kill().unwrap();
        child.wait().unwrap();
        model.apply(&reader.join().unwrap());
        let (store, opened) =
            BatchedPageStore::open(config(scenario), None, Backing::SharedUnlocked { key })
                .unwrap();
        assert!(
            matches!(opened, Opened::Resumed { lost: 0, .. }),
            "round {round}: {opened:?}"
        );
        mismatches += model.check(&store, scenario.pages());
        store.shutdown();
    }
    assert!(trueno_ublk::mem::Segment::remove_shared(key).unwrap());
    assert_eq!(mismatches, 0, "pages differing from the model");
    assert!(
        model.last_version > ROUNDS * 20,
        "the children did too little work: {}",
        model.last_version
    );
}
