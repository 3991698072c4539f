//! `rdmablk-docgen OUT_DIR`: writes the man pages and shell completions of
//! the Debian package under OUT_DIR (see the library; scripts/build-deb.sh
//! runs it). Not part of the package.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [out] = args.as_slice() else {
        eprintln!("usage: rdmablk-docgen OUT_DIR");
        return ExitCode::from(2);
    };
    match rdmablk_docgen::generate(&PathBuf::from(out)) {
        Ok(files) => {
            for f in files {
                println!("{}", f.display());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rdmablk-docgen: {out}: {e}");
            ExitCode::FAILURE
        }
    }
}
