//! Who is at the other end of a connection we accepted: the dialer's hello
//! names an endpoint id anyone can claim, so a name given to a connection
//! (NIXL's agent names, a service's own) is proven by asking the endpoint
//! the caller already trusts by its address whether it dialed it.
//!
//! The question (`ControlFrame::Vouch`) goes on a socket of its own to
//! that endpoint's listener and is answered by its accept loop, not its
//! application: "which address did you dial the connection of this nonce
//! to?" The nonce is chosen by the dialer and known to the two sides only;
//! the answer must be one of our own addresses. A third party that dialed
//! us cannot make the endpoint at `at` answer for it: that endpoint dialed
//! no connection with this nonce, or dialed it to someone else (the third
//! party itself, relaying). With a shared secret the answer carries a MAC
//! over our fresh challenge, so nothing on the path can forge it.

use std::net::SocketAddr;

use super::table::Origin;
use super::Endpoint;
use crate::error::{ConnId, Result};
use crate::oob::{handshake, Ctl};

/// # Proving who a peer is
impl Endpoint {
    /// Whether the far end of `conn` is the endpoint listening at `at`
    /// (the address in metadata the caller trusts, e.g. loaded for a peer
    /// it knows by name). For a connection we dialed: whether we dialed
    /// `at`. For one we accepted: the endpoint at `at` is asked (one round
    /// trip on a fresh socket, within the connect timeout) whether it
    /// dialed this connection to us. `Ok(false)` means someone else
    /// dialed it; an error, that `at` could not be asked (unreachable,
    /// refused, an answer without the secret's MAC, no answer: the endpoint
    /// at `at` answers from its accept loop, so it must accept — passive
    /// accept, or a thread in `accept`) — nothing proven either way.
    ///
    /// ```no_run
    /// # fn f(ep: &ferry::Endpoint, conn: ferry::ConnId, trusted: &[u8]) -> ferry::Result<()> {
    /// let meta = ferry::EndpointMetadata::decode(trusted)?;
    /// if !ep.vouch(conn, meta.socket_addr())? {
    ///     ep.remove_remote(conn)?; // it claimed a name it does not hold
    /// }
    /// # Ok(()) }
    /// ```
    pub fn vouch(&self, conn: ConnId, at: SocketAddr) -> Result<bool> {
        self.inner.reap_closed();
        let origin = self
            .inner
            .conns
            .live
            .lock()
            .expect("lock")
            .get(&conn)
            .map(|c| c.origin);
        let nonce = match origin {
            None => return Err(self.inner.gone(conn)),
            Some(Origin::Dialed { to, .. }) => return Ok(to == Some(at)),
            Some(Origin::Accepted { nonce }) => nonce,
        };
        let mut ctl = Ctl::new(self.inner.me.backend)?;
        let timeout = self.inner.cfg.connect_timeout();
        let dialed = handshake::vouch(&mut ctl, at, nonce, timeout, self.inner.auth_key())?;
        Ok(dialed.is_some_and(|d| self.is_ours(d)))
    }

    /// Whether `addr` reaches our listener: the address we advertise, or
    /// the one it is bound to.
    fn is_ours(&self, addr: SocketAddr) -> bool {
        addr == self.inner.me.metadata.socket_addr()
            || self
                .inner
                .accept
                .listener
                .local_addr()
                .is_ok_and(|l| l == addr)
    }
}
