# References for gpuc.deseq._rrandom (R's random streams) and the simulated dispersion prior variance of R DESeq2's
# estimateDispersionsPriorVar (n - p = 1, 2, 3).
# Run from this folder: Rscript make_reference.R [path to the shared airway folder, optional]
# R 4.2.2, DESeq2 1.38.3, default RNG kinds (Mersenne-Twister, Inversion, Rejection).
suppressPackageStartupMessages(library(DESeq2))
fmt <- function(v) sprintf("%.17g", v)

# 1. random streams, each after set.seed(2)
k <- 300
s <- list()
set.seed(2); s$runif <- runif(k)
set.seed(2); s$rnorm <- rnorm(k)
set.seed(2); s$rexp <- rexp(k)
set.seed(2); s$rchisq1 <- rchisq(k, 1)
set.seed(2); s$rchisq2 <- rchisq(k, 2)
set.seed(2); s$rchisq3 <- rchisq(k, 3)
# the simulation's order of draws: rchisq, then rnorm (sd 0 draws nothing), then rnorm with sd > 0
set.seed(2); s$mixed <- c(rchisq(k / 3, 3), rnorm(k / 3, 0, 0), rnorm(k / 3, 0, sqrt(8 / 199)))
write.csv(as.data.frame(lapply(s, fmt)), "rng_streams.csv", row.names = FALSE, quote = FALSE)

# 2. small simulated sets with n - p = 1, 2, 3 (~condition, 2 coefficients): per-gene values and dispPriorVar
sets <- list()
for (df in 1:3) {
  set.seed(100 + df)
  m <- df + 2
  ng <- 1500
  mu <- 2^rnorm(ng, 6, 2)
  disp <- (0.05 + 2 / mu) * exp(rnorm(ng, 0, c(2.5, 1.5, 0.9)[df]))  # spread enough to lift the prior variance off its 0.25 floor
  cond <- factor(rep(c("A", "B"), times = c(ceiling(m / 2), floor(m / 2))))
  lfc <- ifelse(runif(ng) < 0.1, rnorm(ng, 0, 1.5), 0)
  cts <- sapply(seq_len(m), function(j) rnbinom(ng, mu = mu * 2^(lfc * (cond[j] == "B")), size = 1 / disp))
  dimnames(cts) <- list(sprintf("g%04d", seq_len(ng)), sprintf("s%d", seq_len(m)))
  dds <- DESeqDataSetFromMatrix(cts, data.frame(condition = cond, row.names = colnames(cts)), ~condition)
  dds <- DESeq(dds, quiet = TRUE)
  pv <- attr(dispersionFunction(dds), "dispPriorVar")
  write.csv(cts, gzfile(sprintf("counts_df%d.csv.gz", df)), quote = FALSE)
  mc <- mcols(dds)
  write.csv(data.frame(dispGeneEst = fmt(mc$dispGeneEst), dispFit = fmt(mc$dispFit),
                       dispersion = fmt(mc$dispersion), row.names = rownames(dds)),
            gzfile(sprintf("genes_df%d.csv.gz", df)), quote = FALSE)
  sets[[length(sets) + 1]] <- data.frame(set = sprintf("df%d", df), n_minus_p = df, dispPriorVar = fmt(pv))
}

# 3. airway ~cell + dex (n - p = 3), when the shared data folder is given
args <- commandArgs(trailingOnly = TRUE)
if (length(args) >= 1) {
  counts <- as.matrix(read.csv(file.path(args[1], "counts.csv"), row.names = 1, check.names = FALSE))
  meta <- read.csv(file.path(args[1], "metadata.csv"), row.names = 1)[colnames(counts), ]
  meta$dex <- factor(meta$dex, c("untrt", "trt"))
  meta$cell <- factor(meta$cell)
  dds <- DESeq(DESeqDataSetFromMatrix(counts, meta, ~ cell + dex), quiet = TRUE)
  sets[[length(sets) + 1]] <- data.frame(set = "airway_cell_dex", n_minus_p = 3,
                                         dispPriorVar = fmt(attr(dispersionFunction(dds), "dispPriorVar")))
}
write.csv(do.call(rbind, sets), "prior_var_R.csv", row.names = FALSE, quote = FALSE)
writeLines(c(R.version.string, paste("DESeq2", packageVersion("DESeq2")), paste(RNGkind(), collapse = " ")),
           "versions.txt")

# 4. loess(y ~ x, span = 0.2) on the variance grid, predicted on the fine grid (the smoother of the KL curve)
set.seed(3)
x <- seq(from = 0, to = 8, length = 200)
y <- sin(x) + (x - 4)^2 / 10 + rnorm(200, 0, 0.2)
fine <- seq(from = 0, to = 8, length = 1000)
write.csv(data.frame(y = fmt(y)), "loess_y.csv", row.names = FALSE, quote = FALSE)
write.csv(data.frame(fit = fmt(predict(loess(y ~ x, span = 0.2), fine))), "loess_fit_R.csv", row.names = FALSE,
          quote = FALSE)

# 5. the KL-divergence curve itself (the body of DESeq2:::estimateDispersionsPriorVar up to the loess), for the
#    df = 3 set's residuals: R's klDivs on the 200-point variance grid
g <- read.csv("genes_df3.csv.gz", row.names = 1)
g <- g[!is.na(g$dispGeneEst), ]
obsDist <- (log(g$dispGeneEst) - log(g$dispFit))[g$dispGeneEst >= 1e-8 * 100]
set.seed(2)
brks <- -20:20 / 2
obsDist <- obsDist[obsDist > min(brks) & obsDist < max(brks)]
obsDistHist <- hist(obsDist, breaks = brks, plot = FALSE)
klDivs <- sapply(seq(from = 0, to = 8, length = 200), function(x) {
  randDist <- log(rchisq(10000, df = 3)) + rnorm(10000, 0, sqrt(x)) - log(3)
  randDist <- randDist[randDist > min(brks) & randDist < max(brks)]
  randDistHist <- hist(randDist, breaks = brks, plot = FALSE)
  z <- c(obsDistHist$density, randDistHist$density)
  small <- min(z[z > 0])
  sum(obsDistHist$density * (log(obsDistHist$density + small) - log(randDistHist$density + small)))
})
write.csv(data.frame(kl = fmt(klDivs)), "kl_df3_R.csv", row.names = FALSE, quote = FALSE)
