//! The handshake: formats compared and the cluster key proven both ways before any page moves.

use strata_kv::auth::ClusterKey;

use super::{
    hello_bytes, nonce, read_frame, write_frame, Frame, Hello, Link, TransferError,
    HANDSHAKE_MAX_FRAME,
};

/// Names the fields in which two formats differ. The receiver logs both sides' values; the
/// peer is told only which fields differ.
fn hello_diff(receiver: &Hello, sender: &Hello) -> Vec<&'static str> {
    let mut d = Vec::new();
    if receiver.model_id != sender.model_id {
        d.push("model");
    }
    if receiver.page_size != sender.page_size {
        d.push("page size");
    }
    if receiver.page_bytes != sender.page_bytes || receiver.layout != sender.layout {
        d.push("page layout");
    }
    d
}

const RECEIVER_PROOF: &str = "strata kv-transfer receiver v2";
const SENDER_PROOF: &str = "strata kv-transfer sender v2";

fn proof(key: Option<&ClusterKey>, context: &str, parts: &[&[u8]]) -> [u8; 32] {
    key.map(|k| k.mac(context, parts)).unwrap_or([0; 32])
}

/// Client side of the handshake: states our format, checks the receiver holds the cluster
/// key (when we have one), proves we do, and waits for the verdict.
pub fn handshake_connect(
    link: &mut dyn Link,
    me: &Hello,
    key: Option<&ClusterKey>,
) -> Result<(), TransferError> {
    let mine = nonce();
    write_frame(
        link,
        &Frame::Hello {
            hello: me.clone(),
            nonce: mine,
        },
    )?;
    let theirs = match read_frame(link, HANDSHAKE_MAX_FRAME)? {
        Frame::Challenge { nonce, proof: p } => {
            if let Some(k) = key {
                if !k.verify(RECEIVER_PROOF, &[&mine, &nonce], &p) {
                    return Err(TransferError::Refused(
                        "the receiver did not prove it holds this deployment's cluster key".into(),
                    ));
                }
            }
            nonce
        }
        Frame::Refuse(r) => return Err(TransferError::Refused(r)),
        f => {
            return Err(TransferError::Protocol(format!(
                "expected Challenge, got {}",
                f.name()
            )))
        }
    };
    let hb = hello_bytes(me);
    let p = proof(key, SENDER_PROOF, &[&theirs, &mine, &hb]);
    write_frame(link, &Frame::Proof { proof: p })?;
    match read_frame(link, HANDSHAKE_MAX_FRAME)? {
        Frame::Accept => Ok(()),
        Frame::Refuse(r) => Err(TransferError::Refused(r)),
        f => Err(TransferError::Protocol(format!(
            "expected Accept, got {}",
            f.name()
        ))),
    }
}

/// Server side of the handshake: reads the sender's format, challenges it, checks its proof of
/// the cluster key (when we have one) and its format. Refusals name what failed only.
pub fn handshake_accept(
    link: &mut dyn Link,
    me: &Hello,
    key: Option<&ClusterKey>,
) -> Result<Hello, TransferError> {
    handshake_accept_if(link, me, key, &mut || true)
}

/// [`handshake_accept`], asking `keep` once the sender is authenticated and its format
/// matches, before `Accept` is written: false ends the handshake without an answer (the
/// sender sees the connection close before the handshake and retries).
pub fn handshake_accept_if(
    link: &mut dyn Link,
    me: &Hello,
    key: Option<&ClusterKey>,
    keep: &mut dyn FnMut() -> bool,
) -> Result<Hello, TransferError> {
    let hello = match read_frame(link, HANDSHAKE_MAX_FRAME) {
        // Another protocol version (a worker of another release, mid-upgrade): told so, so
        // that it fails at once naming both versions instead of reconnecting until its
        // deadline. Nothing else is said to a peer not yet authenticated.
        Err(TransferError::Refused(why)) => {
            let _ = write_frame(link, &Frame::Refuse(why.clone()));
            return Err(TransferError::Refused(why));
        }
        r => r?,
    };
    let (peer, theirs) = match hello {
        Frame::Hello { hello, nonce } => (hello, nonce),
        f => {
            return Err(TransferError::Protocol(format!(
                "expected Hello, got {}",
                f.name()
            )))
        }
    };
    let mine = nonce();
    let p = proof(key, RECEIVER_PROOF, &[&theirs, &mine]);
    write_frame(
        link,
        &Frame::Challenge {
            nonce: mine,
            proof: p,
        },
    )?;
    let given = match read_frame(link, HANDSHAKE_MAX_FRAME)? {
        Frame::Proof { proof } => proof,
        f => {
            return Err(TransferError::Protocol(format!(
                "expected Proof, got {}",
                f.name()
            )))
        }
    };
    let refuse = |link: &mut dyn Link, why: String| {
        let _ = write_frame(link, &Frame::Refuse(why.clone()));
        Err(TransferError::Refused(why))
    };
    let authentic = match key {
        Some(k) => k.verify(SENDER_PROOF, &[&mine, &theirs, &hello_bytes(&peer)], &given),
        None => given == [0; 32],
    };
    if !authentic {
        return refuse(
            link,
            "authentication failed: the sender does not hold this receiver's cluster key".into(),
        );
    }
    let diff = hello_diff(me, &peer);
    if !diff.is_empty() {
        tracing::warn!(receiver = ?me, sender = ?peer, "KV formats differ");
        return refuse(
            link,
            format!("the workers' KV formats differ in: {}", diff.join(", ")),
        );
    }
    if !keep() {
        return Err(TransferError::Io(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "the connection gave up its place before the handshake ended",
        )));
    }
    write_frame(link, &Frame::Accept)?;
    Ok(peer)
}
