//! Unreliable Datagram (UD) queue pairs: a small datagram endpoint that sends messages to
//! (GID or LID, QPN, Q_Key) through an address handle and tells where a received one came
//! from.
//!
//! A UD queue pair needs no connection: [`QueuePair::create_ud`] makes one,
//! [`QueuePair::activate_ud`] moves it to RTS with its Q_Key, and every send names its
//! destination ([`QueuePair::post_send_datagram`] with an [`AddressHandle`]). A message is
//! one packet, so it must fit the path MTU; messages are neither acknowledged nor resent.
//!
//! Every receive buffer of a UD queue pair starts with [`GRH_BYTES`] bytes that the device
//! fills with the packet's network header when the completion has `IBV_WC_GRH` in its
//! `wc_flags` (always on RoCE; on InfiniBand only for globally routed packets); the
//! payload follows it, and the completion's `byte_len` counts both. [`grh_source_gid`]
//! reads the sender's GID from that header, which, with the completion's `src_qp`, is the
//! source a receiver checks.

use std::ptr::{self, NonNull};

use crate::device::{CompletionQueue, ProtectionDomain, QpCaps, QueuePair};
use crate::error::VerbsError;
use crate::ops;
use crate::sys::*;

/// The bytes at the start of every UD receive buffer that hold the packet's network header
/// (an InfiniBand Global Route Header, with the layout of an IPv6 header): the payload
/// starts after them.
pub const GRH_BYTES: usize = 40;

/// The hop limit an [`AddressHandle`] routed by GID puts in its packets: on RoCE v2 it is
/// the IP TTL / hop limit, so it must let a packet cross routers (1 would keep it on the
/// sender's subnet).
const HOP_LIMIT: u8 = 64;

/// The largest QP number: QPNs are 24 bits on the wire.
const MAX_QPN: u32 = 0xff_ffff;

/// Where a datagram goes: a port, by GID or LID, and a queue pair on it with its Q_Key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DatagramDest {
    /// The destination port's GID; all zero to route by [`DatagramDest::lid`] alone. RoCE
    /// has no LIDs, so there it must be set.
    pub gid: [u8; 16],
    /// The destination port's LID (InfiniBand; zero on RoCE).
    pub lid: u16,
    /// The destination queue pair's number (24 bits).
    pub qpn: u32,
    /// The destination queue pair's Q_Key: a datagram carrying another is dropped by the
    /// receiver.
    pub qkey: u32,
}

impl DatagramDest {
    /// The destination is routed globally, by its GID (`is_global` in the address).
    pub fn is_global(&self) -> bool {
        self.gid != [0; 16]
    }

    /// Refuses a destination that names no port (neither a GID nor a LID) or a QP number
    /// that does not fit in 24 bits.
    pub fn validate(&self) -> Result<(), VerbsError> {
        if !self.is_global() && self.lid == 0 {
            return Err(VerbsError::InvalidArgument(format!(
                "datagram destination QPN {:#x} has neither a GID nor a LID",
                self.qpn
            )));
        }
        if self.qpn > MAX_QPN {
            return Err(VerbsError::InvalidArgument(format!(
                "datagram destination QPN {:#x} does not fit in 24 bits",
                self.qpn
            )));
        }
        Ok(())
    }

    /// The address attributes of this destination, reached from `port` with the local GID
    /// at `sgid_index` when routed globally.
    fn ah_attr(&self, port: u8, sgid_index: u8) -> Result<ibv_ah_attr, VerbsError> {
        self.validate()?;
        let mut attr = ibv_ah_attr {
            // An InfiniBand packet routed globally still goes to a LID on the local
            // subnet (the router's or the destination's), so the LID is kept either way.
            dlid: self.lid,
            port_num: port,
            ..Default::default()
        };
        if self.is_global() {
            attr.is_global = 1;
            attr.grh.dgid = ibv_gid { raw: self.gid };
            attr.grh.sgid_index = sgid_index;
            attr.grh.hop_limit = HOP_LIMIT;
        }
        Ok(attr)
    }
}

/// An address handle (`ibv_create_ah`): the route to one [`DatagramDest`] that UD sends
/// name. Holds its protection domain, which outlives it.
pub struct AddressHandle {
    pd: ProtectionDomain,
    ah: NonNull<ibv_ah>,
    dest: DatagramDest,
}

// SAFETY: verbs objects may be used from any thread (rdma-core serialises inside).
unsafe impl Send for AddressHandle {}
// SAFETY: as above; the handle is never changed after creation.
unsafe impl Sync for AddressHandle {}

impl AddressHandle {
    /// Creates the address handle of `dest` on `pd`, sending from `port` with the local GID
    /// at `sgid_index` (used only when `dest` has a GID). Refuses a destination with
    /// neither a GID nor a LID ([`DatagramDest::validate`]).
    pub fn new(
        pd: &ProtectionDomain,
        dest: &DatagramDest,
        port: u8,
        sgid_index: u8,
    ) -> Result<Self, VerbsError> {
        let mut attr = dest.ah_attr(port, sgid_index)?;
        // SAFETY: live PD; attr is fully initialised.
        let ah = unsafe { (pd.verbs().ibv_create_ah)(pd.as_ptr(), &mut attr) };
        let ah = NonNull::new(ah).ok_or_else(|| {
            VerbsError::from_errno(format!(
                "ibv_create_ah(port {port}, {})",
                if dest.is_global() {
                    format!("GID {}, source GID index {sgid_index}", gid_text(&dest.gid))
                } else {
                    format!("LID {}", dest.lid)
                }
            ))
        })?;
        Ok(AddressHandle {
            pd: pd.clone(),
            ah,
            dest: *dest,
        })
    }

    /// The raw address handle.
    pub fn as_ptr(&self) -> *mut ibv_ah {
        self.ah.as_ptr()
    }

    /// The destination it was made for.
    pub fn dest(&self) -> &DatagramDest {
        &self.dest
    }
}

impl Drop for AddressHandle {
    fn drop(&mut self) {
        // SAFETY: the AH is live; sends that named it are the caller's to have completed,
        // as with any verbs object; the PD is held by self until after this returns.
        unsafe { (self.pd.verbs().ibv_destroy_ah)(self.ah.as_ptr()) };
    }
}

impl QueuePair {
    /// Creates a UD QP whose completions go to `send_cq` and `recv_cq`, with requests
    /// signaled only when they ask to be (`sq_sig_all = 0`). Activate it with
    /// [`QueuePair::activate_ud`].
    pub fn create_ud(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: QpCaps,
    ) -> Result<Self, VerbsError> {
        Self::create(pd, send_cq, recv_cq, caps, IBV_QPT_UD, "UD")
    }

    /// Moves a UD QP made by [`QueuePair::create_ud`] through INIT (on `port`, P_Key index
    /// 0, Q_Key `qkey`), RTR and RTS (first PSN `psn`), after which it sends and receives.
    /// It then takes only datagrams that carry `qkey`. A Q_Key with its top bit set is a
    /// controlled one, which the kernel lets only privileged processes give a QP.
    pub fn activate_ud(&self, port: u8, qkey: u32, psn: u32) -> Result<(), VerbsError> {
        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_INIT,
            pkey_index: 0,
            port_num: port,
            qkey,
            ..Default::default()
        };
        self.modify(
            &mut attr,
            IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY,
            &format!("INIT, UD on port {port}, Q_Key {qkey:#x}"),
        )?;

        // A UD QP has no remote side: RTR takes nothing but the state.
        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            ..Default::default()
        };
        self.modify(&mut attr, IBV_QP_STATE, "RTR, UD")?;

        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            sq_psn: psn & 0xff_ffff,
            ..Default::default()
        };
        self.modify(&mut attr, IBV_QP_STATE | IBV_QP_SQ_PSN, "RTS, UD")
    }

    /// Moves the QP back to RESET (`ibv_modify_qp`): what is posted is dropped, and
    /// [`QueuePair::activate_ud`] brings it up again with the same number. The way back
    /// from the error state, into which a device may move a UD QP (Soft-RoCE does, on a
    /// datagram longer than the receive it lands in).
    pub fn reset(&self) -> Result<(), VerbsError> {
        let mut attr = ibv_qp_attr {
            qp_state: IBV_QPS_RESET,
            ..Default::default()
        };
        self.modify(&mut attr, IBV_QP_STATE, "RESET")
    }

    /// Posts one SEND of `sge` over UD (`ibv_post_send`) to queue pair `dest_qpn` behind
    /// `ah`, with Q_Key `qkey` (a Q_Key with its top bit set makes the device send the QP's
    /// own instead). `signaled` asks for a completion; `inline` copies the payload into the
    /// request (`IBV_SEND_INLINE`), so the buffer may be reused at once and its key is not
    /// read, and is refused above the QP's granted `max_inline_data`.
    ///
    /// The payload must fit the path MTU; the address handle must be on the QP's
    /// protection domain.
    #[allow(clippy::too_many_arguments)] // each is one field of the one request, as in C
    pub fn post_send_datagram(
        &self,
        wr_id: u64,
        sge: ibv_sge,
        ah: &AddressHandle,
        dest_qpn: u32,
        qkey: u32,
        signaled: bool,
        inline: bool,
    ) -> Result<(), VerbsError> {
        if dest_qpn > MAX_QPN {
            return Err(VerbsError::InvalidArgument(format!(
                "datagram destination QPN {dest_qpn:#x} does not fit in 24 bits"
            )));
        }
        let max_inline = self.caps().max_inline_data;
        if inline && sge.length > max_inline {
            return Err(VerbsError::InvalidArgument(format!(
                "an inline datagram of {} bytes is above the QP's {max_inline} inline bytes",
                sge.length
            )));
        }
        // SAFETY: both objects are live; their `pd` fields are set at creation and never
        // change.
        let (qp_pd, ah_pd) = unsafe { ((*self.as_ptr()).pd, (*ah.as_ptr()).pd) };
        if qp_pd != ah_pd {
            // A device may reject such a send only at completion time, or not at all.
            return Err(VerbsError::InvalidArgument(
                "the address handle is on another protection domain than the QP".into(),
            ));
        }
        let mut sge = sge;
        let mut wr = ibv_send_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
            opcode: IBV_WR_SEND,
            send_flags: if signaled { IBV_SEND_SIGNALED } else { 0 }
                | if inline { IBV_SEND_INLINE } else { 0 },
            ..Default::default()
        };
        wr.wr.ud = ibv_send_wr__bindgen_ty_2__bindgen_ty_3 {
            ah: ah.as_ptr(),
            remote_qpn: dest_qpn,
            remote_qkey: qkey,
        };
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP and AH (borrowed for the call); the request and its SGE live until
        // the call returns, and a posted UD request keeps no pointer to them.
        let rc = unsafe { ops::post_send(self.as_ptr(), &mut wr, &mut bad) };
        if rc == 0 {
            Ok(())
        } else {
            Err(VerbsError::from_code(
                format!(
                    "ibv_post_send(UD SEND of {} bytes to QPN {dest_qpn:#x})",
                    sge.length
                ),
                rc,
            ))
        }
    }
}

/// The source GID in the network header at the start of a UD receive buffer (`grh`, at
/// least [`GRH_BYTES`] long; the payload after it is ignored). Only meaningful when the
/// completion has `IBV_WC_GRH` in its `wc_flags`: without it the bytes are not written.
/// `None` for a buffer shorter than [`GRH_BYTES`] or one that holds neither header form.
///
/// The 40 bytes hold one of two headers:
///
/// - an InfiniBand GRH, which RoCE v1 and RoCE v2 over IPv6 also use: it has the layout of
///   an IPv6 header, with IP version 6 in the top four bits of byte 0 and the source GID
///   (the IPv6 source address) at bytes 8..24;
/// - for RoCE v2 over IPv4, the packet's IPv4 header in the *last* 20 bytes (20..40). The
///   first 20 bytes are then not defined by the verbs: Soft-RoCE zeroes them, hardware may
///   leave anything there. The source GID is the IPv4 source address (bytes 32..36) in the
///   IPv4-mapped IPv6 form `::ffff:a.b.c.d`, which is how RoCE v2 writes an IPv4 address as
///   a GID (and so what the sender's port GID is).
///
/// Since the first 20 bytes may be garbage, a version nibble of 6 at byte 0 does not by
/// itself prove an IPv6 header, and the IPv4 header's checksum cannot be required either:
/// Soft-RoCE delivers a datagram between two of its own QPs without the IP stack, with the
/// checksum field left 0. The header is told apart as the Linux kernel's
/// `ib_get_rdma_header_version` and libibverbs' `ibv_init_ah_from_wc` tell it apart:
///
/// 1. Byte 0 without version 6: no IPv6 header, so bytes 20..40 must be the IPv4 one,
///    version 4 with a header length of five words (RoCE v2 carries no IP options; the
///    kernel looks at the version only). Its checksum is not read (Soft-RoCE's is 0).
/// 2. Byte 0 with version 6: an IPv6 / InfiniBand GRH, unless bytes 20..40 are an IPv4
///    header of five words with a valid checksum (undefined first bytes that happen to
///    start with a 6 do not hide the IPv4 header after them).
/// 3. Otherwise `None`.
///
/// An IPv6 header whose bytes 20..40 happen to form a valid IPv4 header is read as IPv4:
/// the same ambiguity the kernel and libibverbs accept, at odds of about one in 2^24.
pub fn grh_source_gid(grh: &[u8]) -> Option<[u8; 16]> {
    let grh = grh.get(..GRH_BYTES)?;
    let ipv4 = &grh[20..GRH_BYTES];
    // Version 4 and a header length of 5 words: RoCE v2 sends no IPv4 options.
    let ipv4_form = ipv4[0] == 0x45;
    let ipv6_form = grh[0] >> 4 == 6;
    let is_ipv4 = if ipv6_form {
        ipv4_form && ipv4_checksum_ok(ipv4)
    } else {
        ipv4_form
    };
    if is_ipv4 {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..16].copy_from_slice(&ipv4[12..16]);
        Some(gid)
    } else if ipv6_form {
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&grh[8..24]);
        Some(gid)
    } else {
        None
    }
}

/// The IPv4 header `header` has a valid checksum: the ones' complement sum of its 16-bit
/// words, the checksum field included, is all ones.
fn ipv4_checksum_ok(header: &[u8]) -> bool {
    let mut sum: u32 = header
        .chunks_exact(2)
        .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum == 0xffff
}

/// A GID as text: the IPv6 notation, which also shows an IPv4-mapped one as `::ffff:a.b.c.d`.
pub fn gid_text(gid: &[u8; 16]) -> String {
    std::net::Ipv6Addr::from(*gid).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An IPv4 header with a known checksum: 192.168.0.1 to 192.168.0.199, UDP, TTL 64,
    /// checksum 0xb861.
    const IPV4_HEADER: [u8; 20] = [
        0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0xb8, 0x61, 0xc0, 0xa8, 0x00,
        0x01, 0xc0, 0xa8, 0x00, 0xc7,
    ];

    const SOURCE_GID: [u8; 16] = [
        0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x11, 0x22, 0xff, 0xfe, 0x33, 0x44, 0x55,
    ];
    const DEST_GID: [u8; 16] = [
        0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x66, 0x77, 0xff, 0xfe, 0x88, 0x99, 0xaa,
    ];

    /// A RoCE v2 IPv6 header: version 6, traffic class 0, flow label 0x12345, payload
    /// length 64, next header UDP, hop limit 64.
    fn ipv6_grh() -> [u8; GRH_BYTES] {
        let mut grh = [0u8; GRH_BYTES];
        grh[..8].copy_from_slice(&[0x60, 0x01, 0x23, 0x45, 0x00, 0x40, 0x11, 0x40]);
        grh[8..24].copy_from_slice(&SOURCE_GID);
        grh[24..40].copy_from_slice(&DEST_GID);
        grh
    }

    fn ipv4_grh(first_twenty: [u8; 20]) -> [u8; GRH_BYTES] {
        let mut grh = [0u8; GRH_BYTES];
        grh[..20].copy_from_slice(&first_twenty);
        grh[20..].copy_from_slice(&IPV4_HEADER);
        grh
    }

    const MAPPED_192_168_0_1: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 192, 168, 0, 1];

    #[test]
    fn an_ipv6_grh_gives_its_source_gid() {
        assert_eq!(grh_source_gid(&ipv6_grh()), Some(SOURCE_GID));
    }

    #[test]
    fn the_payload_after_the_grh_is_ignored() {
        let mut buf = ipv6_grh().to_vec();
        buf.extend_from_slice(&[0x45; 64]);
        assert_eq!(grh_source_gid(&buf), Some(SOURCE_GID));
    }

    #[test]
    fn a_roce_v2_ipv4_header_gives_the_mapped_source_address() {
        let got = grh_source_gid(&ipv4_grh([0; 20]));
        assert_eq!(got, Some(MAPPED_192_168_0_1));
        assert_eq!(
            got.map(|g| gid_text(&g)).as_deref(),
            Some("::ffff:192.168.0.1")
        );
    }

    #[test]
    fn an_ipv4_header_is_found_behind_undefined_first_bytes() {
        // A device may leave anything in the first 20 bytes, even a 6 in the version nibble.
        assert_eq!(
            grh_source_gid(&ipv4_grh([0x6a; 20])),
            Some(MAPPED_192_168_0_1)
        );
        assert_eq!(
            grh_source_gid(&ipv4_grh([0xff; 20])),
            Some(MAPPED_192_168_0_1)
        );
    }

    #[test]
    fn an_ipv4_header_without_its_checksum_is_taken_after_zeroed_first_bytes() {
        let mut unsummed = ipv4_grh([0; 20]);
        unsummed[30] = 0;
        unsummed[31] = 0;
        assert_eq!(grh_source_gid(&unsummed), Some(MAPPED_192_168_0_1));
        // The header as Soft-RoCE (Linux 6.1) wrote it for a datagram between two of its
        // own QPs over 192.0.2.1: first 20 bytes zeroed, checksum field 0.
        let mut soft_roce = [0u8; GRH_BYTES];
        soft_roce[20..].copy_from_slice(&[
            0x45, 0x00, 0x00, 0x38, 0x51, 0x2d, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0x00,
            0x02, 0x01, 0xc0, 0x00, 0x02, 0x01,
        ]);
        assert_eq!(
            grh_source_gid(&soft_roce).map(|g| gid_text(&g)).as_deref(),
            Some("::ffff:192.0.2.1")
        );
    }

    #[test]
    fn an_ipv4_header_with_options_is_no_source() {
        // Options (IHL 6) never occur in RoCE v2.
        let mut options = ipv4_grh([0; 20]);
        options[20] = 0x46;
        assert_eq!(grh_source_gid(&options), None);
    }

    #[test]
    fn after_a_version_6_an_ipv4_header_needs_its_checksum() {
        // Version 6 at byte 0 and an IPv4 header with a wrong checksum behind it: IPv6.
        let mut grh = ipv4_grh([0; 20]);
        grh[0] = 0x60;
        grh[31] ^= 1;
        let mut want = [0u8; 16];
        want.copy_from_slice(&grh[8..24]);
        assert_eq!(grh_source_gid(&grh), Some(want));
        // The same with the zero checksum that is taken only after non-IPv6 first bytes.
        grh[30] = 0;
        grh[31] = 0;
        assert_eq!(grh_source_gid(&grh), Some(want));
    }

    #[test]
    fn short_and_garbage_buffers_are_no_source() {
        assert_eq!(grh_source_gid(&[]), None);
        assert_eq!(grh_source_gid(&ipv6_grh()[..GRH_BYTES - 1]), None);
        assert_eq!(grh_source_gid(&[0; GRH_BYTES]), None);
        assert_eq!(grh_source_gid(&[0xff; GRH_BYTES]), None);
        assert_eq!(grh_source_gid(&[0x12; GRH_BYTES]), None);
        assert_eq!(grh_source_gid(&[0x44; GRH_BYTES]), None);
        let mut v4_nibble_only = [0u8; GRH_BYTES];
        v4_nibble_only[20] = 0x40;
        assert_eq!(grh_source_gid(&v4_nibble_only), None);
    }

    #[test]
    fn the_checksum_test_accepts_exactly_a_valid_header() {
        assert!(ipv4_checksum_ok(&IPV4_HEADER));
        for byte in 0..20 {
            let mut h = IPV4_HEADER;
            h[byte] ^= 0x10;
            assert!(!ipv4_checksum_ok(&h), "byte {byte} flipped");
        }
    }

    fn dest(gid: [u8; 16], lid: u16) -> DatagramDest {
        DatagramDest {
            gid,
            lid,
            qpn: 0x11,
            qkey: 0x1111_2222,
        }
    }

    #[test]
    fn a_destination_with_a_gid_is_routed_globally() {
        let attr = dest(DEST_GID, 0).ah_attr(1, 3);
        let attr = attr.ok().map(|a| {
            // SAFETY: the union's every bit pattern is a byte array.
            (
                a.is_global,
                unsafe { a.grh.dgid.raw },
                a.grh.sgid_index,
                a.grh.hop_limit,
                a.port_num,
            )
        });
        assert_eq!(attr, Some((1, DEST_GID, 3, HOP_LIMIT, 1)));
    }

    #[test]
    fn a_destination_with_only_a_lid_is_routed_locally() {
        let attr = dest([0; 16], 7).ah_attr(2, 3);
        let attr = attr.ok().map(|a| {
            // SAFETY: as above.
            (a.is_global, a.dlid, a.port_num, unsafe { a.grh.dgid.raw })
        });
        assert_eq!(attr, Some((0, 7, 2, [0; 16])));
    }

    #[test]
    fn a_destination_without_gid_or_lid_is_refused() {
        let d = dest([0; 16], 0);
        assert!(!d.is_global());
        let err = d
            .validate()
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("neither a GID nor a LID"), "{err}");
        assert!(matches!(
            d.ah_attr(1, 0),
            Err(VerbsError::InvalidArgument(_))
        ));
    }

    #[test]
    fn a_destination_qpn_must_fit_in_24_bits() {
        let mut d = dest(DEST_GID, 0);
        d.qpn = MAX_QPN;
        assert!(d.validate().is_ok());
        d.qpn = MAX_QPN + 1;
        assert!(matches!(d.validate(), Err(VerbsError::InvalidArgument(_))));
    }
}
