//! The `ferry` command-line tool.

mod args;
mod bench;
mod child;
mod dir;
mod info;
mod plot;
mod raw;
mod serve;
mod stat;

use anyhow::Result;

use args::Args;

const HELP: &str = "\
ferry: one-sided WRITE/READ between registered memory regions

Usage: ferry <command> [flags]

Commands:
  bench      measure WRITE/READ throughput and latency against a target
             process it starts (the main job; try `ferry bench --baseline`)
  info       which transports and control-path backends work here, and why
             the others do not
  serve      run a target endpoint until stdin closes (used by bench and tests)
  stat       what a running `ferry serve --metrics ADDR` is doing
  ls         the endpoints published in an etcd directory (`--directory URL`)
  help       this text; `ferry <command> --help` for a command's flags

Environment (read once at start; see README.md for all of them):
  FERRY_LOG=warn|info|debug|trace   log level (default warn)
  FERRY_IO=auto|uring|epoll         control-path backend
  FERRY_TRANSPORT=auto|tcp|shm      data path (auto: shm for a same-host peer)
  FERRY_AUTH_KEY=SECRET             peers must prove this shared secret
  FERRY_MAX_INFLIGHT_OPS, FERRY_MAX_CONNS, FERRY_STREAMS, FERRY_SHARDS,
  FERRY_*_TIMEOUT_MS ...";

fn init_logs() {
    let level = std::env::var("FERRY_LOG").unwrap_or_else(|_| "warn".into());
    let filter = match level.trim().to_ascii_lowercase().as_str() {
        "off" => tracing::level_filters::LevelFilter::OFF,
        "error" => tracing::level_filters::LevelFilter::ERROR,
        "info" => tracing::level_filters::LevelFilter::INFO,
        "debug" => tracing::level_filters::LevelFilter::DEBUG,
        "trace" => tracing::level_filters::LevelFilter::TRACE,
        "warn" => tracing::level_filters::LevelFilter::WARN,
        _ => {
            eprintln!(
                "ferry: FERRY_LOG={level:?} is not a level (off, error, warn, info, debug, trace); using warn"
            );
            tracing::level_filters::LevelFilter::WARN
        }
    };
    tracing_subscriber::fmt()
        .with_max_level(filter)
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> Result<()> {
    // Die quietly on a closed pipe (`ferry info | head`), as CLI tools do,
    // instead of panicking in println!.
    // SAFETY: resetting a signal's disposition to the default at start-up,
    // before any thread exists.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    init_logs();
    let mut argv: Vec<String> = std::env::args().skip(1).collect();
    dir::take_etcd_flags(&mut argv)?;
    let Some(cmd) = argv.first() else {
        println!("{HELP}");
        return Ok(());
    };
    let rest = &argv[1..];
    let wants_help = rest.iter().any(|a| a == "--help" || a == "-h");
    match cmd.as_str() {
        "help" | "--help" | "-h" => println!("{HELP}"),
        "bench" if wants_help => println!(
            "{}\n\n{}\n\n{}",
            bench::HELP,
            bench::compress::HELP,
            dir::ETCD_FLAGS
        ),
        "bench" => bench::run(Args::parse(rest, &["latency", "baseline", "json"])?)?,
        "info" if wants_help => println!("{}", info::HELP),
        "info" => info::run(Args::parse(rest, &[])?)?,
        "serve" if wants_help => println!("{}\n\n{}", serve::HELP, dir::ETCD_FLAGS),
        "serve" => serve::run(Args::parse(rest, &["replace"])?)?,
        "stat" if wants_help => println!("{}", stat::HELP),
        "stat" => stat::run(rest)?,
        "ls" if wants_help => println!("{}\n\n{}", dir::LS_HELP, dir::ETCD_FLAGS),
        "ls" => dir::ls(Args::parse(rest, &["json"])?)?,
        "raw-peer" => raw::serve()?,
        "busy" => child::busy(),
        other => anyhow::bail!("unknown command {other:?}; see `ferry help`"),
    }
    Ok(())
}
