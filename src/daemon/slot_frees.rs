//! The serving process's slot-free probe (see `crate::slotfree`), attached once the device is
//! live. The main thread frees the reported slots' pages every `slotfree::POLL`, between
//! signals; writes withdraw the reports of their pages (`StoreHandler`).

#![forbid(unsafe_code)]

use std::sync::Arc;

use super::handler::StoreHandler;
use crate::slotfree::SlotFreeProbe;

/// Attach the probe for `/dev/ublkb{id}`, of `pages` pages, without using it yet: a standby's,
/// made before its takeover (attaching allocates: the BTF read, the kernel's verifier, the
/// bitmap; after a takeover at the watermark that failed with ENOMEM in the VM). What it
/// reports before `attach` gives it to a handler is forgotten there.
pub(super) fn attach_ahead(id: u32, pages: u64) -> Result<SlotFreeProbe, String> {
    attach_to(block_device_number(id)?, pages)
}

fn attach_to((major, minor): (u32, u32), pages: u64) -> Result<SlotFreeProbe, String> {
    SlotFreeProbe::attach(major, minor, pages).map_err(|error| error.to_string())
}

/// Give the probe attached ahead to the handler, while the device is quiesced (a takeover),
/// if it still watches `/dev/ublkb{id}`: a device deleted and made again since, under the same
/// id, may have another number, and the old one may be another swap device's by now (whose
/// frees would then empty this store's pages). `None` when it does not, or the number cannot
/// be read: the caller attaches a probe once the device is live (`attach`), as attaching
/// allocates, which must not wait on a device that waits for us.
pub(super) fn give_ahead(
    id: u32,
    pages: u64,
    handler: &StoreHandler,
    ahead: SlotFreeProbe,
) -> Option<Arc<SlotFreeProbe>> {
    match block_device_number(id) {
        Ok(current) if ahead.device() == current => Some(give(ahead, pages, handler)),
        Ok(current) => {
            tracing::info!(
                ?current,
                ahead = ?ahead.device(),
                "the device's number changed since the slot-free probe was attached ahead"
            );
            None
        }
        Err(why) => {
            tracing::info!(%why, "the slot-free probe attached ahead cannot be checked");
            None
        }
    }
}

/// Attach the probe for `/dev/ublkb{id}`, of `pages` pages, and give it to the handler; `Err`
/// says why there is none (the store then hears of freed slots only through discards).
pub(super) fn attach(
    id: u32,
    pages: u64,
    handler: &StoreHandler,
) -> Result<Arc<SlotFreeProbe>, String> {
    let probe = attach_to(block_device_number(id)?, pages)?;
    Ok(give(probe, pages, handler))
}

fn give(probe: SlotFreeProbe, pages: u64, handler: &StoreHandler) -> Arc<SlotFreeProbe> {
    let probe = Arc::new(probe);
    handler.set_slot_frees(probe.clone());
    // The probe set bits from its attachment on, and writes withdraw their pages' bits only
    // from here on: a bit set in between may be of a slot given out again and written
    // meanwhile. Withdraw them all (a free forgotten is only memory, which discards return).
    probe.forget(0, pages);
    probe
}

/// `major:minor` of `/dev/ublkb{id}`, from sysfs.
fn block_device_number(id: u32) -> Result<(u32, u32), String> {
    let path = format!("/sys/block/ublkb{id}/dev");
    let text = std::fs::read_to_string(&path).map_err(|error| format!("{path}: {error}"))?;
    let (major, minor) = text
        .trim()
        .split_once(':')
        .ok_or_else(|| format!("{path}: not major:minor"))?;
    let number = |s: &str| {
        s.parse::<u32>()
            .map_err(|_| format!("{path}: not major:minor"))
    };
    Ok((number(major)?, number(minor)?))
}
