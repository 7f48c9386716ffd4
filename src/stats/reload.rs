//! What became of a reload, told to the process that asked for it. A SIGHUP carries nothing
//! back, so the supervisor writes each reload's outcome as a line of `ublkbN.reload` beside
//! the device's socket, naming the process whose SIGHUP it answers, and `trueno-ublk reload`
//! (what `systemctl reload` runs) reads it: a refused or failed reload is reported at once,
//! with its reason, instead of looking like one still under way until the command's timeout.
//!
//! A line: `NANOS PID done` or `NANOS PID failed WHY`, NANOS the wall clock's nanoseconds
//! since the epoch when it was written (so that a command takes only lines written after it
//! signalled, whichever supervisor wrote them), PID the process that sent the SIGHUP.

use std::collections::VecDeque;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Lines kept: the outcomes of reloads asked for at about the same time, each for its asker.
const KEPT_OUTCOMES: usize = 8;

/// How a reload ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// The binary on disk serves the device (or, with no process serving, runs the next one).
    Done,
    /// Refused or failed; the running build serves on. Why, as the log says it.
    Failed(String),
}

/// The file of device `id`'s reload outcomes in `dir`.
pub fn outcome_path(dir: &Path, id: u32) -> PathBuf {
    dir.join(format!("ublkb{id}.reload"))
}

fn nanos(at: SystemTime) -> u128 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos())
}

fn format_line(at: SystemTime, asker: i32, outcome: &ReloadOutcome) -> String {
    match outcome {
        ReloadOutcome::Done => format!("{} {asker} done", nanos(at)),
        // One line: a reason never spans more.
        ReloadOutcome::Failed(why) => {
            format!("{} {asker} failed {}", nanos(at), why.replace('\n', " "))
        }
    }
}

fn parse_line(line: &str) -> Option<(u128, i32, ReloadOutcome)> {
    let mut fields = line.splitn(4, ' ');
    let at = fields.next()?.parse().ok()?;
    let asker = fields.next()?.parse().ok()?;
    let outcome = match (fields.next()?, fields.next()) {
        ("done", None) => ReloadOutcome::Done,
        ("failed", why) => ReloadOutcome::Failed(why.unwrap_or_default().to_owned()),
        _ => return None,
    };
    Some((at, asker, outcome))
}

/// The outcome of the reload `asker` asked for at `since` or later, once the device's
/// supervisor has written it (`None` before, and from a supervisor that writes none: an
/// older build).
pub fn outcome_for(path: &Path, asker: i32, since: SystemTime) -> Option<ReloadOutcome> {
    let text = fs::read_to_string(path).ok()?;
    let since = nanos(since);
    text.lines()
        .rev()
        .filter_map(parse_line)
        .find(|&(at, pid, _)| pid == asker && at >= since)
        .map(|(_, _, outcome)| outcome)
}

/// The supervisor's side: the outcomes it has written, and whose reload is under way.
#[derive(Debug, Default)]
pub struct ReloadOutcomes {
    /// `None` until the device's id is known (the kernel picks it unless `--id` was given).
    path: Option<PathBuf>,
    kept: VecDeque<String>,
    /// The process whose SIGHUP the reload under way answers (`None`: no reload under way).
    asker: Option<i32>,
}

impl ReloadOutcomes {
    /// Write to device `id`'s file in `dir` from now on; no earlier outcome counts (each
    /// line's time tells a command which are its own).
    pub fn set_device(&mut self, dir: &Path, id: u32) {
        self.path = Some(outcome_path(dir, id));
    }

    /// A reload is under way for `asker`: `done` or `failed` tells it how it ended.
    pub fn asked(&mut self, asker: i32) {
        self.asker = Some(asker);
    }

    /// Write `outcome` for `asker`: a SIGHUP answered at once (refused, or done at once when no
    /// process serves: the next start runs the binary on disk), or the reload under way ended.
    pub fn answer(&mut self, asker: i32, outcome: &ReloadOutcome) {
        if self.kept.len() == KEPT_OUTCOMES {
            self.kept.pop_front();
        }
        self.kept
            .push_back(format_line(SystemTime::now(), asker, outcome));
        if let Err(error) = self.write() {
            // The outcome is in the log too; the command then waits for its timeout.
            tracing::warn!(%error, "cannot write the reload's outcome for `trueno-ublk reload`");
        }
    }

    /// The reload under way succeeded.
    pub fn done(&mut self) {
        if let Some(asker) = self.asker.take() {
            self.answer(asker, &ReloadOutcome::Done);
        }
    }

    /// The reload under way failed (`why`).
    pub fn failed(&mut self, why: &str) {
        if let Some(asker) = self.asker.take() {
            self.answer(asker, &ReloadOutcome::Failed(why.to_owned()));
        }
    }

    /// The file is gone with the supervisor (a device deleted, a stop).
    pub fn remove(&self) {
        if let Some(path) = &self.path {
            let _ = fs::remove_file(path);
        }
    }

    /// The whole file anew, renamed into place: a reader never sees half of it.
    fn write(&self) -> io::Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let mut text = String::new();
        for line in &self.kept {
            text.push_str(line);
            text.push('\n');
        }
        let partial = path.with_extension("reload.partial");
        fs::write(&partial, text)?;
        fs::rename(&partial, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn lines_read_back_as_written() {
        let at = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        for outcome in [
            ReloadOutcome::Done,
            ReloadOutcome::Failed("a reload is under way".into()),
            ReloadOutcome::Failed(String::new()),
        ] {
            let line = format_line(at, 4242, &outcome);
            assert_eq!(
                parse_line(&line),
                Some((1_700_000_000_123_456_789, 4242, outcome))
            );
        }
        let two_lines = ReloadOutcome::Failed("cannot start\nthe binary".into());
        assert_eq!(
            parse_line(&format_line(at, 1, &two_lines)),
            Some((
                nanos(at),
                1,
                ReloadOutcome::Failed("cannot start the binary".into())
            ))
        );
        for junk in [
            "",
            "1 2",
            "x 2 done",
            "1 y done",
            "1 2 maybe",
            "1 2 done extra",
        ] {
            assert_eq!(parse_line(junk), None, "{junk:?}");
        }
    }

    #[test]
    fn a_command_reads_its_own_outcome_and_none_older_than_its_signal() {
        let dir = tempfile::tempdir().unwrap();
        let path = outcome_path(dir.path(), 3);
        let mut outcomes = ReloadOutcomes::default();
        // Before the id is known nothing is written, and nothing fails.
        outcomes.answer(
            7,
            &ReloadOutcome::Failed("the device is not live yet".into()),
        );
        assert!(!path.exists());
        outcomes.set_device(dir.path(), 3);
        let before = SystemTime::now() - Duration::from_secs(1);
        outcomes.answer(7, &ReloadOutcome::Failed("stopping".into()));
        // Lines are stamped to the nanosecond: the command's time is after that one.
        std::thread::sleep(Duration::from_millis(2));
        let since = SystemTime::now();
        assert_eq!(
            outcome_for(&path, 7, since),
            None,
            "written before it asked"
        );
        assert_eq!(
            outcome_for(&path, 7, before),
            Some(ReloadOutcome::Failed("stopping".into()))
        );
        outcomes.asked(8);
        outcomes.answer(9, &ReloadOutcome::Failed("a reload is under way".into()));
        assert_eq!(outcome_for(&path, 8, since), None, "still under way");
        assert_eq!(
            outcome_for(&path, 9, since),
            Some(ReloadOutcome::Failed("a reload is under way".into()))
        );
        outcomes.done();
        assert_eq!(outcome_for(&path, 8, since), Some(ReloadOutcome::Done));
        // Told once: a later failure is no one's.
        outcomes.failed("the standby ended");
        assert_eq!(outcome_for(&path, 8, since), Some(ReloadOutcome::Done));
        // Only the last few are kept.
        for asker in (100..).take(KEPT_OUTCOMES) {
            outcomes.answer(asker, &ReloadOutcome::Done);
        }
        assert_eq!(outcome_for(&path, 8, since), None);
        assert_eq!(
            fs::read_to_string(&path).unwrap().lines().count(),
            KEPT_OUTCOMES
        );
        outcomes.remove();
        assert!(!path.exists());
    }
}
