# R 4.2.2 / DESeq2 1.38.3 (reference BLAS): R's own values that gpuc reproduces bit for bit, for
# tests/deseq/test_rmath.py. Writes every double as a C99 hex float ("%a"), so nothing is lost in the text.
#   special.csv   x, lgamma(x), digamma(x)  (R's lgammafn and digamma at awkward and random arguments)
#   lm_<d>.csv    per gene: counts, size factors (DESeq2 median of ratios), linearModelMuNormalized means
#   lp_<d>.csv    per gene: counts, means (floored at 0.5), log alpha, and fitDisp's log posterior and derivative
#                 there (fitDispWrapper with maxit = 0 returns them as initial_lp / initial_dlp)
# for the designs ~1, ~condition and ~type + condition on 300 pasilla genes with a count, and
#   start_pbmc_cd14.csv.gz  per gene of the CD14 pseudobulk (../prefit, 24 samples, ~group) with a count: baseMean,
#                 baseVar, the rough and moments starting values and their bounded minimum (estimateDispersionsGeneEst's
#                 alpha_init), and R's dispGeneEst with its dispGeneIter
#   trend_pasilla_condition.csv  pasilla ~condition after estimateDispersions: the parametric trend's coefficients
#                 and dispPriorVar, and the 300 genes' dispGeneEst, dispFit, dispMAP and final dispersion
# Run: Rscript make_reference.R /path/to/shared/data/bulk/pasilla
suppressMessages(library(DESeq2))
args <- commandArgs(trailingOnly = TRUE)
src <- if (length(args)) args[1] else "/work/shared/data/bulk/pasilla"
hx <- function(v) sprintf("%a", v)
set.seed(7)
x <- c(1e-4, 0.3, 0.5, 1, 1.5, 2, 2.5, 8.999, 9, 9.001, 9.5, 10, 10.000001, 10.5, 123.4, 1e4, 4934719, 4934721, 9.5e7,
       exp(runif(200, log(1e-4), log(1e8))), runif(100, 0.01, 12))
write.csv(data.frame(x = hx(x), lgamma = hx(lgamma(x)), digamma = hx(digamma(x))), "special.csv", row.names = FALSE,
          quote = FALSE)
cts <- as.matrix(read.csv(file.path(src, "counts.csv"), row.names = 1, check.names = FALSE))
md <- read.csv(file.path(src, "metadata.csv"), row.names = 1)
md$condition <- factor(md$condition, levels = c("untreated", "treated"))
md$type <- factor(md$type)
keep <- sort(sample(which(rowSums(cts) > 0), 300))
for (d in c("1", "condition", "type_condition")) {
  design <- switch(d, "1" = ~1, condition = ~condition, type_condition = ~type + condition)
  dds <- estimateSizeFactors(DESeqDataSetFromMatrix(cts, md, design))[keep, ]
  mm <- model.matrix(design, md)
  mu <- DESeq2:::linearModelMuNormalized(dds, mm)
  y <- counts(dds)
  n <- ncol(y)
  out <- data.frame(gene = rownames(dds))
  for (j in seq_len(n)) out[[paste0("y", j)]] <- y[, j]
  for (j in seq_len(n)) out[[paste0("mu", j)]] <- hx(mu[, j])
  sf <- matrix(hx(sizeFactors(dds)), nrow = 1)
  colnames(sf) <- paste0("sf", seq_len(n))
  write.csv(cbind(out, sf[rep(1, nrow(out)), , drop = FALSE]), paste0("lm_", d, ".csv"), row.names = FALSE,
            quote = FALSE)
  mu <- pmax(mu, 0.5)
  la <- runif(nrow(y), log(1e-6), log(20))
  r <- DESeq2:::fitDispWrapper(ySEXP = y, xSEXP = mm, mu_hatSEXP = mu, log_alphaSEXP = la,
                               log_alpha_prior_meanSEXP = la - 0.5, log_alpha_prior_sigmasqSEXP = 0.7,
                               min_log_alphaSEXP = log(1e-9), kappa_0SEXP = 1, tolSEXP = 1e-6, maxitSEXP = 0,
                               usePriorSEXP = TRUE, weightsSEXP = matrix(1, nrow(y), n), useWeightsSEXP = FALSE,
                               weightThresholdSEXP = 1e-2, useCRSEXP = TRUE)
  lp <- data.frame(gene = rownames(dds))
  for (j in seq_len(n)) lp[[paste0("y", j)]] <- y[, j]
  for (j in seq_len(n)) lp[[paste0("mu", j)]] <- hx(mu[, j])
  lp$la <- hx(la)
  lp$lp <- hx(r$initial_lp)
  lp$dlp <- hx(r$initial_dlp)
  write.csv(lp, paste0("lp_", d, ".csv"), row.names = FALSE, quote = FALSE)
}
cts <- as.matrix(read.csv(gzfile("../prefit/pbmc_cd14_counts.csv.gz"), row.names = 1, check.names = FALSE))
storage.mode(cts) <- "integer"
md <- read.csv("../prefit/pbmc_cd14_metadata.csv", row.names = 1)[colnames(cts), , drop = FALSE]
md$group <- factor(md$group, levels = c("ctrl", "stim"))
dds <- estimateSizeFactors(DESeqDataSetFromMatrix(cts, md, ~group))
dds <- DESeq2:::getBaseMeansAndVariances(dds)
nz <- dds[!mcols(dds)$allZero, ]
mm <- model.matrix(~group, md)
rough <- DESeq2:::roughDispEstimate(y = counts(nz, normalized = TRUE), x = mm)
mom <- DESeq2:::momentsDispEstimate(nz)
nz <- estimateDispersionsGeneEst(nz, quiet = TRUE)
write.csv(data.frame(gene = rownames(nz), baseMean = hx(mcols(nz)$baseMean), baseVar = hx(mcols(nz)$baseVar),
                     rough = hx(rough), moments = hx(mom),
                     alpha_init = hx(pmin(pmax(1e-8, pmin(rough, mom)), max(10, ncol(nz)))),
                     dispGeneEst = hx(mcols(nz)$dispGeneEst), dispGeneIter = mcols(nz)$dispGeneIter),
          gzfile("start_pbmc_cd14.csv.gz"), row.names = FALSE, quote = FALSE)
cts <- as.matrix(read.csv(file.path(src, "counts.csv"), row.names = 1, check.names = FALSE))
md <- read.csv(file.path(src, "metadata.csv"), row.names = 1)
md$condition <- factor(md$condition, levels = c("untreated", "treated"))
dds <- estimateDispersions(estimateSizeFactors(DESeqDataSetFromMatrix(cts, md, ~condition)), quiet = TRUE)
fn <- dispersionFunction(dds)
co <- attr(fn, "coefficients")
g <- mcols(dds)[keep, ]
write.csv(rbind(data.frame(gene = c("asymptDisp", "extraPois", "dispPriorVar"), dispGeneEst = NA, dispFit = NA,
                           dispMAP = NA, dispersion = hx(c(co[[1]], co[[2]], attr(fn, "dispPriorVar")))),
                data.frame(gene = rownames(g), dispGeneEst = hx(g$dispGeneEst), dispFit = hx(g$dispFit),
                           dispMAP = hx(g$dispMAP), dispersion = hx(g$dispersion))),
          "trend_pasilla_condition.csv", row.names = FALSE, quote = FALSE)
writeLines(capture.output(sessionInfo()), "sessionInfo.txt")
