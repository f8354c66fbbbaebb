//! How a same-host target moves a checked request's bytes: a pure choice,
//! made from the request and what this side holds, apart from the copying
//! (`local.rs`).

/// Host copies at least this long are spread over the shards (when there
/// are several): below it one thread's copy is as fast as the hand-off.
pub(crate) const SPREAD_COPY_MIN: usize = 1 << 20;

/// The facts the choice rests on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Request {
    /// A WRITE into our memory (else a READ of it).
    pub write: bool,
    /// Our window or the initiator's memory is on a GPU.
    pub gpu: bool,
    /// Bytes that came inline in the request.
    pub inline_len: usize,
    /// The checked length.
    pub len: usize,
    /// Most bytes a reply carries inline.
    pub max_inline: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyPath {
    /// A GPU side: the shard copies with CUDA and answers later.
    Cuda,
    /// A WRITE whose bytes came whole in the request.
    FromRequest,
    /// A READ small enough to answer in the reply.
    InReply,
    /// Large: the shards copy slices and answer; if they cannot take it,
    /// copied here.
    Spread,
    /// Copied here, now: through our mapping of the initiator's memfd
    /// when we have one (a memcpy), else with `process_vm_readv/writev`.
    Here,
}

pub(crate) fn choose(r: &Request) -> CopyPath {
    if r.gpu {
        CopyPath::Cuda
    } else if r.write && r.inline_len == r.len {
        CopyPath::FromRequest
    } else if !r.write && r.len <= r.max_inline {
        CopyPath::InReply
    } else if r.len >= SPREAD_COPY_MIN {
        CopyPath::Spread
    } else {
        CopyPath::Here
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(write: bool, len: usize, inline_len: usize) -> Request {
        Request {
            write,
            gpu: false,
            inline_len,
            len,
            max_inline: 200,
        }
    }

    #[test]
    fn each_path_by_its_facts() {
        let gpu = Request {
            gpu: true,
            ..req(true, 8, 8)
        };
        assert_eq!(choose(&gpu), CopyPath::Cuda);
        assert_eq!(choose(&req(true, 100, 100)), CopyPath::FromRequest);
        assert_eq!(choose(&req(true, 0, 0)), CopyPath::FromRequest);
        assert_eq!(choose(&req(false, 200, 0)), CopyPath::InReply);
        assert_eq!(choose(&req(false, 201, 0)), CopyPath::Here);
        assert_eq!(choose(&req(true, 5000, 0)), CopyPath::Here);
        assert_eq!(choose(&req(false, SPREAD_COPY_MIN, 0)), CopyPath::Spread);
        assert_eq!(choose(&req(true, SPREAD_COPY_MIN - 1, 0)), CopyPath::Here);
    }
}
