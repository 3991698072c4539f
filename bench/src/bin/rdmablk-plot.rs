//! rdmablk-plot: SVG pictures of benchmark results (a latency histogram of a
//! fio json+ report, values over time from fio's logs, the chart of
//! bench/compare.sh's results). A thin wrapper over
//! [`rdmablk_bench::plot::main_with_args`].

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(rdmablk_bench::plot::main_with_args(&args));
}
