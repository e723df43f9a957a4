//! `sparda synth`: write a random-weight checkpoint.

use crate::*;
use sparda::Result;

pub(crate) fn cmd_synth(a: SynthArgs) -> Result<()> {
    let preset = sparda::synth::Preset::from_name(&a.preset)?;
    if !a.force {
        if a.out.is_file() {
            return Err(sparda::Error::Input(format!(
                "--out {} is a file; give a directory",
                a.out.display()
            )));
        }
        let entries = std::fs::read_dir(&a.out).map(|d| d.count()).unwrap_or(0);
        if entries > 0 {
            return Err(sparda::Error::Input(format!(
                "--out {} is not empty ({entries} entries): a checkpoint written there would mix with what it holds; choose an empty or new directory, or add --force",
                a.out.display()
            )));
        }
    }
    sparda::synth::write(preset, a.seed, &a.out, &a.tokenizer)?;
    eprintln!(
        "wrote {} ({} preset, seed {})",
        a.out.display(),
        a.preset,
        a.seed
    );
    if a.forecast {
        let path = a.out.join("forecast.safetensors");
        let tensors =
            sparda::model::forecast::ForecastWeights::synth_tensors(&preset.config(), a.seed);
        sparda::weights::write_safetensors(&path, &tensors)?;
        eprintln!("wrote {} (random forecast weights)", path.display());
    }
    Ok(())
}
