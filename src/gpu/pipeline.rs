//! The batch pipeline: a batch is cut into chunks of `chunk_pages`; chunk `k` goes to slot
//! `k % slots`, each slot with its own stream and pinned buffers, so that while the host packs
//! chunk `k + 2`, the GPU copies chunk `k + 1` in and runs the kernel on chunk `k`, and copies
//! chunk `k - 1` out. The host waits for a slot only when it needs it again.
//!
//! The driver calls live behind `DeviceSlot` (`cuda.rs` on a GPU); the tests run the same
//! pipeline on `ModelDevice` slots that execute the kernels' CPU model, with faults injected
//! at the same points.

#![allow(
    clippy::cast_possible_truncation,
    reason = "offsets and lengths are within a chunk of at most thousands of 4 KiB pages"
)]
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use rayon::prelude::*;

use super::model::{self, LEN_RAW, STATUS_CORRUPT, STATUS_OK, STATUS_WRONG_LENGTH};
use super::{BatchTimes, FaultPoint, Faults, GpuError};
use crate::codec::{CodecError, CompressedBatch, Encoding, Page, PAGE_SIZE};

/// Fewest pages per chunk when a batch is spread over the slots (64 blocks of 4 warps).
const MIN_CHUNK_PAGES: usize = 256;

/// Fewest pages per rayon task when packing and unpacking.
const PAR_MIN_PAGES: usize = 64;

/// What a slot runs on its chunk.
#[derive(Clone, Copy, Debug)]
pub(super) enum Job {
    /// `pages` pages in `input`; page `i`'s LZ4 goes to output slot `i` and its length (or
    /// `LEN_RAW`) to word `i`.
    Compress { pages: usize, max_out: u32 },
    /// `pages` compressed pages packed in `input[..bytes]`, page `i` at `index[i]` with
    /// `index[chunk_pages + i]` bytes; page `i` goes to output slot `i`, its status to word `i`.
    Decompress { pages: usize, bytes: usize },
}

/// One pipeline slot: pinned host buffers, device buffers and a stream.
pub(super) trait DeviceSlot: Send {
    /// Host staging buffer for the chunk's input, `chunk_pages * PAGE_SIZE` bytes.
    fn input(&mut self) -> Result<&mut [u8], GpuError>;
    /// Host staging buffer for decompress offsets and lengths, `2 * chunk_pages` words.
    fn index(&mut self) -> Result<&mut [u32], GpuError>;
    /// Enqueues copy in, kernel and copy out; does not wait.
    fn submit(&mut self, job: Job) -> Result<(), GpuError>;
    /// Waits for what was submitted (a job, or part of one whose submit failed) and returns a
    /// job's GPU event times; `GpuError::Hung` once it has waited `hang_after`, and then the
    /// slot must never be touched again (see `Pipeline::abandon_slots`).
    fn wait(&mut self, hang_after: Duration) -> Result<BatchTimes, GpuError>;
    /// The finished job's output slots and per-page words.
    fn output(&mut self) -> Result<(&[u8], &[u32]), GpuError>;
}

/// Makes slots on one device.
pub(super) trait SlotFactory: Send {
    fn new_slot(
        &self,
        chunk_pages: usize,
        faults: Arc<Faults>,
    ) -> Result<Box<dyn DeviceSlot>, GpuError>;
    /// Free and total device memory.
    fn memory_info(&self) -> Option<(usize, usize)>;
}

pub(super) struct Pipeline {
    factory: Box<dyn SlotFactory>,
    /// Allocated at the first batch; dropped after a failed batch so the next one starts clean.
    slots: Vec<Box<dyn DeviceSlot>>,
    /// The pages each of `slots` holds: the chunks of the largest batch so far, at most
    /// `chunk_pages`. Why not `chunk_pages` at once: the buffers are pinned (locked) memory,
    /// and a store's batches of 1,000 pages are cut into chunks of 334, a sixth of the 2,048
    /// that sizing by `chunk_pages` locked.
    slot_pages: usize,
    slot_count: usize,
    chunk_pages: usize,
    hang_after: Duration,
    faults: Arc<Faults>,
}

impl Pipeline {
    pub(super) fn new(
        factory: Box<dyn SlotFactory>,
        slot_count: usize,
        chunk_pages: usize,
        hang_after: Duration,
        faults: Arc<Faults>,
    ) -> Self {
        Self {
            factory,
            slots: Vec::new(),
            slot_pages: 0,
            slot_count,
            chunk_pages,
            hang_after,
            faults,
        }
    }

    pub(super) fn memory_info(&self) -> Option<(usize, usize)> {
        self.factory.memory_info()
    }

    /// Compresses `pages` into `out`: LZ4 where the kernel's output fits in `max_out` bytes,
    /// `Raw` otherwise.
    pub(super) fn compress(
        &mut self,
        pages: &[&Page],
        max_out: u32,
        out: &mut CompressedBatch,
    ) -> Result<BatchTimes, GpuError> {
        let n = pages.len();
        // No zeroing of the slots: `harvest` writes every page's bytes, and only `len` of them
        // are read.
        out.reset(n);
        // Packing and unpacking are plain copies of up to `chunk_pages` pages: spread over the
        // cores, so that the host side keeps up with the copies and the kernel.
        let fill = |slot: &mut dyn DeviceSlot, first: usize, count: usize| {
            let input = &mut slot.input()?[..count * PAGE_SIZE];
            input
                .par_chunks_exact_mut(PAGE_SIZE)
                .zip(pages[first..first + count].par_iter())
                .with_min_len(PAR_MIN_PAGES)
                .for_each(|(dst, page)| dst.copy_from_slice(&page[..]));
            Ok(Job::Compress {
                pages: count,
                max_out,
            })
        };
        let harvest = |slot: &mut dyn DeviceSlot, first: usize, count: usize| {
            let (data, lens) = slot.output()?;
            let slots = out.data[first * PAGE_SIZE..(first + count) * PAGE_SIZE]
                .par_chunks_exact_mut(PAGE_SIZE)
                .zip(out.lens[first..first + count].par_iter_mut())
                .zip(out.encodings[first..first + count].par_iter_mut());
            let results = data[..count * PAGE_SIZE]
                .par_chunks_exact(PAGE_SIZE)
                .zip(lens[..count].par_iter())
                .zip(pages[first..first + count].par_iter());
            slots.zip(results).with_min_len(PAR_MIN_PAGES).try_for_each(
                |(((dst, len_out), encoding), ((src, &len), page))| {
                    match len {
                        LEN_RAW => {
                            dst.copy_from_slice(&page[..]);
                            *len_out = crate::codec::page_len(PAGE_SIZE);
                            *encoding = Encoding::Raw;
                        }
                        len if len <= max_out => {
                            let len = len as usize;
                            dst[..len].copy_from_slice(&src[..len]);
                            *len_out = crate::codec::page_len(len);
                            *encoding = Encoding::Lz4;
                        }
                        len => {
                            return Err(GpuError::BadOutput(format!(
                                "compressed length {len} above the limit {max_out}"
                            )))
                        }
                    }
                    Ok(())
                },
            )
        };
        let result = self.run(n, fill, harvest);
        self.reset_after(result)
    }

    /// Decompresses the LZ4 pages `indices` of `inputs` (each at most `PAGE_SIZE` bytes) into
    /// `out`, with a status per page.
    pub(super) fn decompress(
        &mut self,
        inputs: &[(Encoding, &[u8])],
        indices: &[usize],
        out: &mut [Page],
        status: &mut [Result<(), CodecError>],
    ) -> Result<BatchTimes, GpuError> {
        let fill = |slot: &mut dyn DeviceSlot, first: usize, count: usize| {
            let chunk = &indices[first..first + count];
            let mut offset = 0usize;
            {
                let index = slot.index()?;
                // Offsets, then lengths from the slot's page count on.
                let slot_pages = index.len() / 2;
                for (i, &page) in chunk.iter().enumerate() {
                    let len = inputs[page].1.len();
                    index[i] = offset as u32;
                    index[slot_pages + i] = len as u32;
                    offset += len;
                }
            }
            let input = slot.input()?;
            let mut offset = 0usize;
            for &page in chunk {
                let bytes = inputs[page].1;
                input[offset..offset + bytes.len()].copy_from_slice(bytes);
                offset += bytes.len();
            }
            Ok(Job::Decompress {
                pages: count,
                bytes: offset,
            })
        };
        let harvest = |slot: &mut dyn DeviceSlot, first: usize, count: usize| {
            let (data, words) = slot.output()?;
            let chunk = &indices[first..first + count];
            let results = data[..count * PAGE_SIZE]
                .par_chunks_exact(PAGE_SIZE)
                .zip(words[..count].par_iter());
            let unpack = |(dst, st): (&mut Page, &mut Result<(), CodecError>), (src, &word)| {
                *st = page_status(word)?;
                if st.is_ok() {
                    dst.copy_from_slice(src);
                }
                Ok(())
            };
            // Indices are increasing: a chunk of consecutive pages (the usual case, a batch of
            // LZ4 pages) is unpacked in parallel, scattered ones in order.
            let (Some(&start), Some(&last)) = (chunk.first(), chunk.last()) else {
                return Ok(());
            };
            if last - start + 1 == count {
                out[start..=last]
                    .par_iter_mut()
                    .zip(status[start..=last].par_iter_mut())
                    .zip(results)
                    .with_min_len(PAR_MIN_PAGES)
                    .try_for_each(|(slot, result)| unpack(slot, result))
            } else {
                let results = data.chunks_exact(PAGE_SIZE).zip(&words[..count]);
                chunk.iter().zip(results).try_for_each(|(&page, result)| {
                    unpack((&mut out[page], &mut status[page]), result)
                })
            }
        };
        let result = self.run(indices.len(), fill, harvest);
        self.reset_after(result)
    }

    /// After a failed batch: let the slots' pending work finish, then drop them (buffers,
    /// streams) so the next batch starts from freshly allocated ones; after a hang, abandon
    /// them.
    fn reset_after(
        &mut self,
        result: Result<BatchTimes, GpuError>,
    ) -> Result<BatchTimes, GpuError> {
        match result {
            Err(GpuError::Hung { .. }) => self.abandon_slots(),
            Err(_) => {
                let hang_after = self.hang_after;
                // The batch already failed; other errors while draining change nothing.
                let drained = self
                    .slots
                    .iter_mut()
                    .all(|slot| !matches!(slot.wait(hang_after), Err(GpuError::Hung { .. })));
                if drained {
                    self.slots.clear();
                } else {
                    self.abandon_slots();
                    return Err(hung(hang_after));
                }
            }
            Ok(_) => {}
        }
        result
    }

    /// Forget the slots without freeing anything: a hung GPU may still copy into their pinned
    /// buffers, and freeing those (or the streams) waits for it. The codec sends no batch here
    /// again (`GpuError::GivenUp`), so this happens once.
    fn abandon_slots(&mut self) {
        for slot in self.slots.drain(..) {
            std::mem::forget(slot);
        }
    }

    /// Runs `total` pages in chunks over the slots: `fill` packs pages `[first, first + count)`
    /// into a slot and says what to run, `harvest` unpacks a finished slot. A batch is cut into
    /// at least as many chunks as there are slots (chunks of `MIN_CHUNK_PAGES` at least), so
    /// that the copies and kernels of even a batch of a few thousand pages overlap.
    fn run<F, H>(
        &mut self,
        total: usize,
        mut fill: F,
        mut harvest: H,
    ) -> Result<BatchTimes, GpuError>
    where
        F: FnMut(&mut dyn DeviceSlot, usize, usize) -> Result<Job, GpuError>,
        H: FnMut(&mut dyn DeviceSlot, usize, usize) -> Result<(), GpuError>,
    {
        if total == 0 {
            return Ok(BatchTimes::default());
        }
        let chunk_len = total
            .div_ceil(self.slot_count)
            .max(MIN_CHUNK_PAGES)
            .min(self.chunk_pages);
        let chunks = total.div_ceil(chunk_len);
        if self.slot_pages < chunk_len {
            // Idle here: the batch before waited for all of its chunks.
            self.slots.clear();
        }
        if self.slots.is_empty() {
            self.slot_pages = self.slot_pages.max(chunk_len);
        }
        while self.slots.len() < self.slot_count {
            self.faults.check(FaultPoint::Alloc)?;
            let slot = self
                .factory
                .new_slot(self.slot_pages, self.faults.clone())?;
            self.slots.push(slot);
        }
        let mut times = BatchTimes::default();
        // (slot, first page, pages) of submitted chunks, oldest first.
        let mut in_flight: VecDeque<(usize, usize, usize)> = VecDeque::new();
        for chunk in 0..chunks {
            let s = chunk % self.slot_count;
            if in_flight.len() == self.slot_count {
                if let Some((done, first, count)) = in_flight.pop_front() {
                    let slot = &mut *self.slots[done];
                    times.add(slot.wait(self.hang_after)?);
                    harvest(slot, first, count)?;
                }
            }
            let first = chunk * chunk_len;
            let count = chunk_len.min(total - first);
            let slot = &mut *self.slots[s];
            let job = fill(slot, first, count)?;
            slot.submit(job)?;
            in_flight.push_back((s, first, count));
        }
        while let Some((done, first, count)) = in_flight.pop_front() {
            let slot = &mut *self.slots[done];
            times.add(slot.wait(self.hang_after)?);
            harvest(slot, first, count)?;
        }
        Ok(times)
    }
}

/// The error of a slot whose work did not finish within `hang_after`.
pub(super) fn hung(hang_after: Duration) -> GpuError {
    GpuError::Hung {
        waited_ms: u64::try_from(hang_after.as_millis()).unwrap_or(u64::MAX),
    }
}

/// The decompress kernel's status word as the page's result; `Err` when the word is not one
/// the kernel can write.
fn page_status(word: u32) -> Result<Result<(), CodecError>, GpuError> {
    let length = word & !STATUS_WRONG_LENGTH;
    match word {
        STATUS_OK => Ok(Ok(())),
        STATUS_CORRUPT => Ok(Err(CodecError::Corrupt)),
        _ if word & STATUS_WRONG_LENGTH != 0 && (length as usize) < PAGE_SIZE => {
            Ok(Err(CodecError::WrongLength(length as usize)))
        }
        _ => Err(GpuError::BadOutput(format!("decompress status {word:#x}"))),
    }
}

impl BatchTimes {
    fn add(&mut self, other: BatchTimes) {
        self.kernel_ns += other.kernel_ns;
        self.transfer_ns += other.transfer_ns;
    }
}

/// Slots that run the kernels' CPU model (`model.rs`) in place of a device, with the same fault
/// points as the CUDA slots: `GpuCodec::on_cpu_model` runs the whole pipeline and fallback logic
/// on machines without a GPU (the tests do).
pub(super) struct ModelDevice;

struct ModelSlot {
    chunk_pages: usize,
    faults: Arc<Faults>,
    input: Vec<Page>,
    index: Vec<u32>,
    output: Vec<Page>,
    words: Vec<u32>,
    job: Option<Job>,
}

impl SlotFactory for ModelDevice {
    fn new_slot(
        &self,
        chunk_pages: usize,
        faults: Arc<Faults>,
    ) -> Result<Box<dyn DeviceSlot>, GpuError> {
        Ok(Box::new(ModelSlot {
            chunk_pages,
            faults,
            input: vec![[0; PAGE_SIZE]; chunk_pages],
            index: vec![0; 2 * chunk_pages],
            output: vec![[0; PAGE_SIZE]; chunk_pages],
            words: vec![0; chunk_pages],
            job: None,
        }))
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        None
    }
}

impl DeviceSlot for ModelSlot {
    fn input(&mut self) -> Result<&mut [u8], GpuError> {
        Ok(self.input.as_flattened_mut())
    }

    fn index(&mut self) -> Result<&mut [u32], GpuError> {
        Ok(&mut self.index)
    }

    fn submit(&mut self, job: Job) -> Result<(), GpuError> {
        self.faults.check(FaultPoint::CopyIn)?;
        self.faults.check(FaultPoint::Launch)?;
        self.job = Some(job);
        self.faults.check(FaultPoint::CopyOut)
    }

    fn wait(&mut self, hang_after: Duration) -> Result<BatchTimes, GpuError> {
        if self.faults.check(FaultPoint::Hang).is_err() {
            // Work that never finishes, waited for as long as the CUDA slot waits.
            std::thread::sleep(hang_after);
            return Err(hung(hang_after));
        }
        self.faults.check(FaultPoint::Sync)?;
        let Some(job) = self.job.take() else {
            return Ok(BatchTimes::default());
        };
        // The "kernel": one model warp per page.
        match job {
            Job::Compress { pages, max_out } => {
                let jobs = self.input[..pages].iter().zip(&mut self.output);
                for ((page, out), word) in jobs.zip(&mut self.words) {
                    *word = model::compress_page(page, max_out as usize, out)
                        .map_or(LEN_RAW, |len| len as u32);
                }
            }
            Job::Decompress { pages, bytes } => {
                let input = &self.input.as_flattened()[..bytes];
                let (offsets, lens) = self.index.split_at(self.chunk_pages);
                let jobs = offsets.iter().zip(lens).zip(&mut self.output);
                for (((&offset, &len), out), word) in jobs.zip(&mut self.words).take(pages) {
                    let (offset, len) = (offset as usize, len as usize);
                    let bytes = input.get(offset..offset + len).ok_or_else(|| {
                        GpuError::BadOutput(format!("page at {offset}+{len} beyond the input"))
                    })?;
                    *word = model::decompress_page(bytes, out);
                }
            }
        }
        Ok(BatchTimes::default())
    }

    fn output(&mut self) -> Result<(&[u8], &[u32]), GpuError> {
        Ok((self.output.as_flattened(), &self.words))
    }
}
