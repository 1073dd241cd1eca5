//! A prefill worker's K/V on its way to the decode worker: once the first part of the prompt's
//! pages is computed, a thread connects to the decode worker's KV listener and announces the
//! transfer (the decode worker's staging and a connection are held from then on, not while the
//! prompt waits or its first chunk computes); each part is sent as the engine computes it (the
//! chunks still to compute overlap the transfer), with a `Wait` while the next part computes;
//! `End` follows the last page.

use std::net::SocketAddr;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;

use strata_engine::transfer::{self, OutPage, TransferError, TransferStats};
use strata_engine::ExportedKv;

use crate::state::AppState;

/// Where the pages go and which they are.
pub(super) struct Route {
    pub addr: SocketAddr,
    pub id: u128,
    pub tokens: Vec<u32>,
    /// The first page sent (the decode worker holds the ones before).
    pub from: usize,
}

/// The shipment of one prompt's pages (see the module docs).
pub(super) struct Shipment {
    route: Option<Route>,
    parts: Option<Sender<Arc<ExportedKv>>>,
    task: Option<tokio::task::JoinHandle<Result<TransferStats, TransferError>>>,
}

impl Shipment {
    pub fn new(route: Route) -> Shipment {
        Shipment {
            route: Some(route),
            parts: None,
            task: None,
        }
    }

    /// Connects and announces the transfer (its first pages are computed).
    fn start(&mut self, st: &AppState) {
        let Some(route) = self.route.take() else {
            return;
        };
        let (tx, rx) = channel();
        let hello = st.engine.info().hello();
        let ps = st.engine.info().page_size;
        let (deadline, key) = (st.pd.kv_deadline, st.cluster_key.clone());
        self.parts = Some(tx);
        self.task = Some(tokio::task::spawn_blocking(move || {
            let mut conn = super::connect_kv(route.addr, &hello, key.as_ref(), deadline)?;
            let pages = (route.tokens.len().div_ceil(ps) - route.from) as u32;
            let mut s = transfer::begin_kv(
                &mut conn,
                route.id,
                &route.tokens,
                route.from as u32,
                pages,
                deadline,
            )?;
            send_parts(&mut s, &rx, route.from, pages)?;
            s.end()
        }));
    }

    /// Hands a part of the pages to the sending thread, started with the first part (a thread
    /// that failed already says why at [`Shipment::finish`]).
    pub fn part(&mut self, st: &AppState, kv: Arc<ExportedKv>) {
        self.start(st);
        if let Some(tx) = &self.parts {
            let _ = tx.send(kv);
        }
    }

    /// Waits for the transfer's end, once every part was handed over. The outer error: the
    /// task itself failed; the inner one: the transfer did.
    pub async fn finish(
        mut self,
    ) -> Result<Result<TransferStats, TransferError>, tokio::task::JoinError> {
        self.parts = None;
        match self.task.take() {
            Some(t) => t.await,
            None => Ok(Err(TransferError::Protocol(
                "no page of the prompt was computed".into(),
            ))),
        }
    }
}

/// Sends the parts (pages from `from` on, in order, without gaps) as they arrive until `pages`
/// pages went; a `Wait` each [`transfer::WAIT_EVERY`] without one. The parts ending early
/// (the prefill failed) or out of order abort.
fn send_parts(
    s: &mut transfer::KvSender<'_>,
    rx: &Receiver<Arc<ExportedKv>>,
    from: usize,
    pages: u32,
) -> Result<(), TransferError> {
    let mut sent = 0u32;
    while sent < pages {
        match rx.recv_timeout(transfer::WAIT_EVERY) {
            Ok(kv) => {
                if kv.first != from + sent as usize || kv.pages.len() != kv.hashes.len() {
                    let why = format!(
                        "a part of {} pages from page {} after page {}",
                        kv.pages.len(),
                        kv.first,
                        from + sent as usize
                    );
                    s.abort(&why);
                    return Err(TransferError::Protocol(why));
                }
                for (d, h) in kv.pages.iter().zip(&kv.hashes) {
                    s.page(&OutPage { hash: *h, data: d })?;
                    sent += 1;
                }
            }
            Err(RecvTimeoutError::Timeout) => s.wait()?,
            Err(RecvTimeoutError::Disconnected) => {
                let why = "the prefill ended before its last pages";
                s.abort(why);
                return Err(TransferError::Protocol(why.into()));
            }
        }
    }
    Ok(())
}
